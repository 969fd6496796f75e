//! Settling an admitted request: whatever way it ends (the last byte relayed, an
//! upstream error, the client gone, a panic), its slot is released and its reservation
//! turned into real usage — the ledger row handed to the write-behind writer (the
//! durable truth, committed within milliseconds and retried until it is), and the live
//! counters settled at once. A settlement the counters' backend does not confirm (a
//! Redis that stalls or is away) is retried in the background until it is confirmed:
//! `finish` is idempotent per lease, so an attempt that did take effect unseen is not
//! counted twice.

use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admission::{Grant, Limiter};
use crate::backoff::Backoff;
use crate::completion::meter::Meter;
use crate::fleet::InFlight;
use crate::http::request_record::RequestRecord;
use crate::metrics::GaugeGuard;
use crate::state::AppState;
use crate::store::{UsageRow, now_unix};

/// Owns an admitted request's slot and reservation until it is settled; dropping it
/// settles it.
pub struct Settlement {
    state: AppState,
    key: i64,
    lease: String,
    grant: Grant,
    /// Prompt tokens as planned (exact or an upper bound), charged when the upstream
    /// did not report usage.
    prompt_tokens: u64,
    pub meter: Meter,
    /// The request's metadata row, held open until the request is settled.
    record: RequestRecord,
    /// Stops the lease renewal (shared backends) once settled.
    renewal: CancellationToken,
    /// Whether the upstream accepted the request (an error status costs nothing).
    charged: bool,
    /// Counts the request in `fleetgate_admission_running` until settled.
    running: Option<GaugeGuard>,
    /// Counts the request in flight on its upstream (for balancing, and in
    /// `fleetgate_in_flight_requests`) from when it is sent until settled (the body
    /// ended, failed or was dropped).
    in_flight: Option<(InFlight, GaugeGuard)>,
    settled: bool,
    /// The usage row's id, when not the lease (see [`Settlement::charge_as`]).
    usage_id: Option<String>,
}

impl Settlement {
    pub fn new(
        state: AppState,
        key: i64,
        lease: String,
        grant: Grant,
        prompt_tokens: u64,
        record: RequestRecord,
    ) -> Self {
        record.hold();
        let renewal = CancellationToken::new();
        if let Some(every) = state.limiter().lease_renewal() {
            let (limiter, lease, stop) = (state.limiter_handle(), lease.clone(), renewal.clone());
            state.tasks().spawn(async move {
                let mut ticks = tokio::time::interval(every);
                ticks.tick().await;
                while stop.run_until_cancelled(ticks.tick()).await.is_some() {
                    if let Err(err) = limiter.renew(key, &lease).await {
                        tracing::warn!(error = %err, request_id = %lease, "could not renew the admission lease");
                    }
                }
            });
        }
        let running = Some(state.metrics().admission_running());
        Self {
            running,
            in_flight: None,
            renewal,
            record,
            state,
            key,
            lease,
            grant,
            prompt_tokens,
            meter: Meter::json(),
            charged: true,
            settled: false,
            usage_id: None,
        }
    }

    /// Records the usage under `id` rather than the lease: a job's id, the same for
    /// every run of it, so that the ledger (one row per id) charges a job once.
    pub fn charge_as(&mut self, id: String) {
        self.usage_id = Some(id);
    }

    /// The request's metadata row.
    pub fn record(&self) -> &RequestRecord {
        &self.record
    }

    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// Holds the upstream's in-flight counts until the request is settled.
    pub fn hold_in_flight(&mut self, load: InFlight, gauge: GaugeGuard) {
        self.in_flight = Some((load, gauge));
    }

    /// The upstream refused or failed before generating: nothing is charged. Returns
    /// once the slot is free again, so the error reaches the client after that (a
    /// client that retries at once finds its slot).
    pub async fn release_unused(mut self) {
        self.charged = false;
        self.finish().await;
    }

    /// Settles, charging what the meter saw; returns once the slot is free again and
    /// the usage queued for the ledger.
    pub async fn finish(mut self) {
        if let Some(settling) = self.settle() {
            // A failed settlement task has logged its error.
            let _ = settling.await;
        }
    }

    /// Prompt and completion tokens to charge: the upstream's own usage when it
    /// reported it, else the planned prompt tokens and what was seen generated.
    fn tokens(&self) -> (u64, u64) {
        if !self.charged {
            return (0, 0);
        }
        match self.meter.reported() {
            Some(counts) => (counts.prompt_tokens, counts.completion_tokens),
            None => (self.prompt_tokens, self.meter.generated()),
        }
    }

    /// Settles (idempotent): at once when the limiter answers without waiting (in
    /// process), else on a tracked task, so that it completes even when the request's
    /// own future is gone. The handle resolves once the slot is released and the usage
    /// row queued for the ledger (or the release handed to the background retry); `None`
    /// when that is already done.
    pub fn settle(&mut self) -> Option<JoinHandle<()>> {
        if std::mem::replace(&mut self.settled, true) {
            return None;
        }
        self.renewal.cancel();
        self.in_flight = None;
        self.running = None;
        let (prompt_tokens, completion_tokens) = self.tokens();
        self.record.set_tokens(prompt_tokens, completion_tokens);
        self.record.release();
        let state = self.state.clone();
        let limiter: Arc<dyn Limiter> = state.limiter_handle();
        let (key, lease, grant) = (self.key, self.lease.clone(), self.grant.clone());
        let usage_id = self.usage_id.take().unwrap_or_else(|| lease.clone());
        let mut settling = Box::pin(async move {
            let row = UsageRow {
                key_id: key,
                request_id: usage_id,
                month: grant.month.to_string(),
                prompt_tokens,
                completion_tokens,
                created_at: now_unix(),
            };
            state.ledger().record(row.clone());
            if let Err(err) = limiter.settle(key, &lease, &grant, &row).await {
                tracing::warn!(error = %err, request_id = %lease, "could not settle the live counters; retrying until they are");
                state
                    .tasks()
                    .spawn(settle_until_confirmed(limiter, key, lease, grant, row));
            }
        });
        // A task of its own costs a spawn and a wake-up of the request's task when it
        // ends, per request; the in-process limiter never needs one. A settlement that
        // does wait is spawned, and its first poll there registers the task's waker.
        let mut cx = Context::from_waker(Waker::noop());
        if settling.as_mut().poll(&mut cx).is_ready() {
            return None;
        }
        Some(self.state.tasks().spawn(settling))
    }
}

/// Pauses between attempts to settle the live counters of a request.
const FINISH_RETRY: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// Retries the settlement until the backend confirms it. On shutdown the tracked tasks
/// are waited for only so long; a settlement still unconfirmed then is in the ledger
/// (the counters are rebuilt from it when they are lost).
async fn settle_until_confirmed(
    limiter: Arc<dyn Limiter>,
    key: i64,
    lease: String,
    grant: Grant,
    row: UsageRow,
) {
    let mut pauses = FINISH_RETRY.pauses();
    loop {
        tokio::time::sleep(pauses.next_pause()).await;
        if limiter.settle(key, &lease, &grant, &row).await.is_ok() {
            tracing::info!(request_id = %lease, "settled the live counters after a retry");
            return;
        }
    }
}

impl Drop for Settlement {
    fn drop(&mut self) {
        let _ = self.settle();
    }
}
