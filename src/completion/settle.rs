//! Settling an admitted request: whatever way it ends (the last byte relayed, an
//! upstream error, the client gone, a panic), its slot is released and its reservation
//! turned into real usage — the ledger row handed to the write-behind writer (the
//! durable truth, committed within milliseconds and retried until it is), and the live
//! counters settled at once. No request is charged more than its reservation: a node
//! that streams past what `max_tokens` allows, or reports usage beyond the
//! reservation, is not believed — charged at most the reservation, and ejected. A
//! whole answer cut short before the node reported its usage is charged for what the
//! node's learned decode speed says it generated meanwhile (`fleet::DecodeRate`). A settlement the counters' backend does not confirm (a
//! Redis that stalls or is away) is retried in the background until it is confirmed:
//! `finish` is idempotent per lease, so an attempt that did take effect unseen is not
//! counted twice.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::renewals::Renewal;
use crate::admission::{Cost, Grant, Limiter};
use crate::backoff::Backoff;
use crate::completion::meter::{Counts, Meter};
use crate::fleet::{Charge, InFlight, Taken, Turn};
use crate::metrics::{GaugeGuard, UpstreamMetrics};
use crate::request_record::RequestRecord;
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
    /// The most tokens a stream's frames can count from an honest node (see
    /// [`Settlement::streamed_past_bound`]).
    frames_bound: u64,
    /// Sequences generated side by side: `prompt_count × n`.
    fan_out: u64,
    pub meter: Meter,
    /// The request's metadata row, held open until the request is settled.
    record: RequestRecord,
    /// Keeps the lease alive (shared backends) until settled.
    renewal: Option<Renewal>,
    /// Whether the upstream accepted the request (an error status costs nothing).
    charged: bool,
    /// Counts the request in `fleetgate_admission_running` until settled.
    running: Option<GaugeGuard>,
    /// Counts the request in flight on its upstream (for balancing, and in
    /// `fleetgate_in_flight_requests`) from when it is sent until settled (the body
    /// ended, failed or was dropped).
    in_flight: Option<(InFlight, GaugeGuard, UpstreamMetrics)>,
    /// Its key's charge in the fleet queue's turns, from when it is sent until settled
    /// (then corrected to what it used).
    charge: Option<Charge>,
    /// The key's `share` of a saturated fleet.
    share: u32,
    /// When the request was sent to its node (with `in_flight`).
    sent: Option<Instant>,
    settled: bool,
    /// The job this is a run of, if it is one (see [`Settlement::charge_as`]).
    job: Option<JobRun>,
}

/// A run of a job, as its settlement charges it.
#[derive(Debug, Clone)]
pub struct JobRun {
    /// The job's id: every run of the job records its usage under it, so that the ledger
    /// (one row per id) charges a job once.
    pub id: String,
    /// Cancelled when the run stops without ending its job: cut by a shutdown (the job is
    /// queued again) or its lease lost (another worker has it). Such a run is charged
    /// nothing, in the live counters as in the ledger: a job is charged for the run that
    /// ends it (its end replaces whatever is under its id with a succeeded run's charge),
    /// so what the counters took for this run would be counted there alone, over the
    /// ledger, until they are next rebuilt from it. Its reservation was held while it
    /// ran: the budget was never exceeded meanwhile.
    pub superseded: CancellationToken,
}

impl Settlement {
    /// `cost`: what the request was planned to cost; `echoed`: the prompt tokens its
    /// choices repeat before what they generate (`echo`), which a stream's logprobs count;
    /// `share`: the key's share of a saturated fleet.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        state: AppState,
        key: i64,
        share: u32,
        lease: String,
        grant: Grant,
        cost: &Cost,
        echoed: u64,
        record: RequestRecord,
    ) -> Self {
        record.hold();
        let renewal = state.renewals().map(|renewals| renewals.hold(key, &lease));
        let running = Some(state.metrics().admission_running());
        // Each choice may end with one frame of its own (its finish reason, no token).
        let frames_bound = cost
            .fan_out
            .saturating_mul(grant.max_tokens.saturating_add(1))
            .saturating_add(echoed);
        Self {
            running,
            in_flight: None,
            charge: None,
            share,
            sent: None,
            renewal,
            record,
            state,
            key,
            lease,
            grant,
            prompt_tokens: cost.prompt_tokens,
            frames_bound,
            fan_out: cost.fan_out,
            meter: Meter::json(),
            charged: true,
            settled: false,
            job: None,
        }
    }

    /// Charges the request as a run of a job: under the job's id rather than the lease,
    /// and nothing once the run is superseded.
    pub fn charge_as(&mut self, job: JobRun) {
        self.job = Some(job);
    }

    /// The request's metadata row.
    pub fn record(&self) -> &RequestRecord {
        &self.record
    }

    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// What the request is charged in its model's fleet queue when a node takes it:
    /// its prompt and the most its choices may generate.
    pub fn turn(&self) -> Turn {
        let generated = self.fan_out.saturating_mul(self.grant.max_tokens);
        Turn::new(self.key, self.share, self.prompt_tokens, generated)
    }

    /// Holds the node taken (counted in flight there, charged to the key) until the
    /// request is settled; the request is sent to it now.
    pub fn hold_in_flight(&mut self, taken: Taken, metrics: UpstreamMetrics) {
        self.in_flight = Some((taken.in_flight, metrics.in_flight(), metrics));
        self.charge = Some(taken.charge);
        self.sent = Some(Instant::now());
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
            settling.await;
        }
    }

    /// Prompt and completion tokens to charge: the upstream's own usage when it
    /// reported it (`reported`), else the planned prompt tokens and what was seen
    /// generated; never more than the reservation together.
    fn tokens(&self, reported: Option<Counts>) -> (u64, u64) {
        if !self.charged {
            return (0, 0);
        }
        let (prompt, completion) = match reported {
            Some(counts) => (counts.prompt_tokens, counts.completion_tokens),
            None => (self.prompt_tokens, self.generated()),
        };
        let prompt = prompt.min(self.grant.reserved);
        (prompt, completion.min(self.grant.reserved - prompt))
    }

    /// What the node generated, as far as can be told without its usage: what a
    /// stream's frames counted, or, for a whole answer cut short (its client gone, its
    /// job cancelled), the time it ran at the node's decode speed.
    fn generated(&self) -> u64 {
        match (&self.meter, &self.in_flight, self.sent) {
            (Meter::Json(_), Some((load, ..)), Some(sent)) => load.upstream().decode.generated(
                sent.elapsed(),
                self.fan_out,
                self.grant.max_tokens,
            ),
            _ => self.meter.generated(),
        }
    }

    /// Whether a stream's frames have counted more tokens than `max_tokens` lets the node
    /// generate. The frames count at most what was generated (a frame a token, or the
    /// tokens its logprobs list), so an honest node never gets there. Cheap: looked at
    /// after every piece relayed.
    pub fn streamed_past_bound(&self) -> bool {
        self.meter.generated() > self.frames_bound
    }

    /// Whether the node answered beyond what the request allows: streamed past the
    /// bound, or reported usage (`reported`) beyond the reservation.
    fn overran(&self, reported: Option<Counts>) -> bool {
        self.streamed_past_bound()
            || reported.is_some_and(|counts| {
                counts
                    .prompt_tokens
                    .saturating_add(counts.completion_tokens)
                    > self.grant.reserved
            })
    }

    /// Settles (idempotent). In process the limiter answers without waiting and this
    /// returns `None`, everything done. Otherwise the returned [`Settling`] resolves once
    /// the slot is released and the usage row queued for the ledger (or the release
    /// handed to the background retry); whoever awaits it runs it, and dropped before
    /// then it finishes on a tracked task, so a request whose future is gone is settled
    /// all the same. `None` also when already settled.
    pub fn settle(&mut self) -> Option<Settling> {
        if std::mem::replace(&mut self.settled, true) {
            return None;
        }
        self.renewal = None;
        // Read once: a whole answer's usage is looked for in the tail of its body.
        let reported = self.meter.reported();
        let (prompt_tokens, completion_tokens) = self.tokens(reported);
        if self.charged && self.overran(reported) {
            self.distrust();
        } else {
            self.learn_speed(reported);
        }
        // Corrected before the slot comes free: whoever it goes to is chosen by it. The
        // fleet's turns count the work the node did, charged to the key or not.
        if let Some(charge) = self.charge.take() {
            charge.settle(prompt_tokens, completion_tokens);
        }
        let job = self.job.take();
        let (prompt_tokens, completion_tokens) = match &job {
            Some(job) if job.superseded.is_cancelled() => (0, 0),
            _ => (prompt_tokens, completion_tokens),
        };
        self.in_flight = None;
        self.running = None;
        self.record.set_tokens(prompt_tokens, completion_tokens);
        self.record.release();
        let state = self.state.clone();
        let limiter: Arc<dyn Limiter> = state.limiter_handle();
        let (key, lease, grant) = (self.key, self.lease.clone(), self.grant.clone());
        // Every run of a job records under the job's id, and the ledger keeps the first
        // row under an id (until the job's end replaces it with a succeeded run's charge).
        // A run that charged nothing (refused before a node had it, or superseded) records
        // no row, so that the row kept is the one of the run that ended the job: what the
        // counters were given for it.
        let recorded = job.is_none() || prompt_tokens + completion_tokens > 0;
        let usage_id = job.map_or_else(|| lease.clone(), |job| job.id);
        let mut settling: SettlingFuture = Box::pin(async move {
            let row = UsageRow {
                key_id: key,
                request_id: usage_id,
                month: grant.month.to_string(),
                prompt_tokens,
                completion_tokens,
                created_at: now_unix(),
            };
            if recorded {
                state.ledger().record(row.clone());
            }
            if let Err(err) = limiter.settle(key, &lease, &grant, &row).await {
                tracing::warn!(error = %err, request_id = %lease, "could not settle the live counters; retrying until they are");
                state
                    .tasks()
                    .spawn(settle_until_confirmed(limiter, key, lease, grant, row));
            }
        });
        // The in-process limiter is done at the first poll. A waker that does nothing is
        // enough for it: whoever goes on with a settlement that waits polls it again
        // with their own.
        let mut cx = Context::from_waker(Waker::noop());
        if settling.as_mut().poll(&mut cx).is_ready() {
            return None;
        }
        Some(Settling {
            future: Some(settling),
            tasks: self.state.tasks().clone(),
        })
    }
}

impl Settlement {
    /// Teaches the node's decode speed what this whole answer took, when the node
    /// reported what it generated (`reported`). (A stream's time is also its client's reading pace.)
    fn learn_speed(&self, reported: Option<Counts>) {
        if let (Meter::Json(_), Some(counts), Some((load, ..)), Some(sent)) =
            (&self.meter, reported, &self.in_flight, self.sent)
        {
            let each = counts.completion_tokens as f64 / self.fan_out.max(1) as f64;
            load.upstream().decode.learn(each, sent.elapsed());
        }
    }

    /// Ejects the node that overran (see [`Settlement::overran`]), even its model's
    /// last: what it answers cannot be charged for.
    fn distrust(&self) {
        let Some((load, _, metrics)) = &self.in_flight else {
            return;
        };
        let node = load.upstream();
        tracing::warn!(
            gpu = %node.gpu,
            request_id = %self.lease,
            "node answered beyond the request's max_tokens or reservation; charged at most the reservation, and ejected"
        );
        if node.health.misbehaved() {
            metrics.ejected();
        }
    }
}

type SettlingFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A settlement waiting for the limiter's backend. Awaited by the request it settles,
/// which is cheaper than a task of its own (no spawn, and the backend's reply wakes the
/// request directly); dropped unfinished (the request's future is gone), the rest runs
/// on a tracked task, waited for on shutdown.
pub struct Settling {
    future: Option<SettlingFuture>,
    tasks: TaskTracker,
}

impl Future for Settling {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Ready(());
        };
        ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(())
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            self.tasks.spawn(future);
        }
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A settlement that waits for `go`, then marks `done`.
    fn waiting(
        go: tokio::sync::oneshot::Receiver<()>,
        done: Arc<AtomicBool>,
        tasks: &TaskTracker,
    ) -> Settling {
        Settling {
            future: Some(Box::pin(async move {
                go.await.unwrap();
                done.store(true, Ordering::SeqCst);
            })),
            tasks: tasks.clone(),
        }
    }

    #[tokio::test]
    async fn awaited_it_runs_in_place() {
        let (tasks, done) = (TaskTracker::new(), Arc::new(AtomicBool::new(false)));
        let (go, wait) = tokio::sync::oneshot::channel();
        let settling = waiting(wait, done.clone(), &tasks);
        go.send(()).unwrap();
        settling.await;
        assert!(done.load(Ordering::SeqCst));
        assert!(tasks.is_empty(), "no task was spawned");
    }

    #[tokio::test]
    async fn dropped_unfinished_it_finishes_on_a_tracked_task() {
        let (tasks, done) = (TaskTracker::new(), Arc::new(AtomicBool::new(false)));
        let (go, wait) = tokio::sync::oneshot::channel();
        let mut settling = waiting(wait, done.clone(), &tasks);
        // Polled once (as a request does before it goes away), then dropped.
        assert!(futures_util::poll!(&mut settling).is_pending());
        drop(settling);
        assert_eq!(tasks.len(), 1);
        go.send(()).unwrap();
        tasks.close();
        tasks.wait().await;
        assert!(done.load(Ordering::SeqCst), "the settlement ran to its end");
    }
}
