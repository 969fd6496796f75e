//! A request that finds its model asleep (scale to zero).
//!
//! Everything that can be decided before the boot is decided first, with a normal
//! status: validation, the key and its limits, and the wake hook's confirmation (a
//! failed wake is a 503). Once the hook has confirmed the boot, the 200 is committed at
//! once and the connection is kept alive while the node boots and the answer is
//! computed: an SSE comment line (`: booting`) for streams, a space for JSON (JSON
//! allows leading whitespace), every `fleet.keepalive_interval_ms`. Then the node's
//! answer flows as usual.
//!
//! If the boot times out or the node then fails, the headers are already sent: the
//! error goes into the body (the contract's "200*" case, without
//! `X-Acs-Upstream-Error-Kind`; the front door renders it as the envelope, the way vLLM
//! reports an error mid-stream).
//!
//! The answer is a [`Booting`]: the events the front door turns into the body, sent by a
//! task of its own that outlives the handler.

use std::time::Instant;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::cut::shutting_down;
use super::dispatch::Window;
use super::outcome::{BootEvent, Booting};
use super::outgoing::Outgoing;
use super::settle::Settlement;
use crate::error::ApiError;
use crate::fleet::{Affinity, Model};
use crate::request_record::RequestRecord;
use crate::state::AppState;

/// Waits until a woken model has a node up, at most its boot timeout.
pub async fn wait_booted(model: &Model) -> Result<(), ApiError> {
    if model
        .wait_up(Instant::now() + model.sleep.boot_timeout)
        .await
    {
        model.boot_done();
        Ok(())
    } else {
        Err(ApiError::UpstreamUnavailable(format!(
            "Model '{}' was woken but no node came up within {} s. Retry later.",
            model.id,
            model.sleep.boot_timeout.as_secs()
        )))
    }
}

/// An admitted request for a booting model, owned so that it can outlive the handler.
pub struct Pending {
    pub state: AppState,
    pub model_id: String,
    pub body: Bytes,
    pub affinity: Affinity,
    pub include_usage: bool,
    pub stream: bool,
    pub window: Window,
}

/// Commits the answer now; the boot, the request and its answer follow as events.
pub fn respond(pending: Pending, settlement: Settlement, request_id: String) -> Booting {
    let (tx, events) = mpsc::channel(16);
    let stream = pending.stream;
    let tasks = pending.state.tasks().clone();
    // In the request's span, so that the boot's wait and the dispatch after it are in
    // its trace.
    tasks.spawn(run(pending, settlement, request_id, tx).in_current_span());
    Booting { stream, events }
}

async fn run(
    pending: Pending,
    settlement: Settlement,
    request_id: String,
    tx: mpsc::Sender<BootEvent>,
) {
    // The metadata row stays open until the outcome is known, so that an in-body error
    // is recorded with its code.
    let record = RecordHold::new(settlement.record().clone());
    let keep_alive = KeepAlive {
        tx: &tx,
        every: std::time::Duration::from_millis(pending.state.config().fleet.keepalive_interval_ms),
        draining: pending.state.draining().clone(),
    };
    let fail = |err: ApiError| {
        record.0.set_in_body_error(err.code());
        tracing::warn!(request_id = %request_id, code = err.code(), "request failed after a confirmed cold boot; the error goes into the 200 body");
        let tx = tx.clone();
        let draining = keep_alive.draining.clone();
        async move {
            tokio::select! {
                biased;
                _ = tx.send(BootEvent::Failed(err)) => {}
                () = draining.cancelled() => {}
            }
        }
    };
    let Ok(model) = pending.state.fleet().resolve(Some(&pending.model_id)) else {
        return;
    };
    match keep_alive.hold(wait_booted(model)).await {
        Held::Done(Ok(())) => {}
        Held::Done(Err(err)) => {
            settlement.release_unused().await;
            return fail(err).await;
        }
        Held::Gone => return settlement.release_unused().await,
        Held::Draining => {
            settlement.release_unused().await;
            return fail(shutting_down()).await;
        }
    }
    let outgoing = Outgoing {
        state: &pending.state,
        model,
        include_usage: pending.include_usage,
        body: pending.body.clone(),
        affinity: pending.affinity,
        window: pending.window,
    };
    // Leaving `send` (client gone, shutdown) drops the settlement, which settles.
    let mut body = match keep_alive.hold(outgoing.send(settlement)).await {
        Held::Done(Ok((relayed, _))) => relayed.body,
        Held::Done(Err(unanswered)) => return fail(unanswered.error).await,
        Held::Gone => return,
        Held::Draining => return fail(shutting_down()).await,
    };
    while let Some(piece) = body.next_piece().await {
        let (event, failed) = match piece {
            Ok(bytes) => (BootEvent::Piece(bytes), false),
            Err(err) => (BootEvent::Cut(err), true),
        };
        // A client that stops reading holds this send, as it would hold any relayed
        // body, but not past the shutdown grace period.
        let sent = tokio::select! {
            sent = tx.send(event) => sent.is_ok(),
            () = keep_alive.draining.cancelled() => false,
        };
        if !sent || failed {
            return;
        }
    }
}

/// Holds a request's metadata row open while it lives.
struct RecordHold(RequestRecord);

impl RecordHold {
    fn new(record: RequestRecord) -> Self {
        record.hold();
        Self(record)
    }
}

impl Drop for RecordHold {
    fn drop(&mut self) {
        self.0.release();
    }
}

struct KeepAlive<'a> {
    tx: &'a mpsc::Sender<BootEvent>,
    every: std::time::Duration,
    draining: CancellationToken,
}

enum Held<T> {
    Done(T),
    /// The client went away.
    Gone,
    /// The shutdown grace period is over.
    Draining,
}

impl KeepAlive<'_> {
    /// Runs `work`, sending a keep-alive every `every` until it is done.
    async fn hold<T>(&self, work: impl Future<Output = T>) -> Held<T> {
        tokio::pin!(work);
        let start = tokio::time::Instant::now() + self.every;
        let mut ticks = tokio::time::interval_at(start, self.every);
        loop {
            tokio::select! {
                out = &mut work => return Held::Done(out),
                () = self.draining.cancelled() => return Held::Draining,
                () = self.tx.closed() => return Held::Gone,
                _ = ticks.tick() => {
                    // A full channel means the client is not reading: no keep-alive needed.
                    if let Err(mpsc::error::TrySendError::Closed(_)) = self.tx.try_send(BootEvent::KeepAlive) {
                        return Held::Gone;
                    }
                }
            }
        }
    }
}
