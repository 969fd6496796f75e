//! Getting the request to a node: pick one (waiting in the fleet queue if all are
//! full), send, and fail over once when the request provably never started there.
//!
//! Failover happens only when the node gave nothing back: the connection was refused
//! or reset before any response byte, or it answered 503 (vLLM's "engine dead") before
//! a body. Then one other node is tried, never more, and never once a response is
//! being relayed. Both cases also eject the node (`fleet/health.rs`), as does any other
//! 5xx, unless it is the model's last node in rotation (see [`eject`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tracing::Instrument;

use crate::completion::settle::Settlement;
use crate::error::ApiError;
use crate::fleet::{Affinity, Model, NoNode, Node};
use crate::metrics::{UpstreamMetrics, UpstreamOutcome};
use crate::state::AppState;
use crate::traces;
use crate::upstream::{NodeReply, upstream_rejection};

/// A node's answer (headers read, body not yet) and what is needed to relay it.
pub struct Dispatched {
    pub response: NodeReply,
    pub upstream: Arc<Node>,
    /// The node's metric series, looked up once per request.
    pub metrics: UpstreamMetrics,
    pub sent: Instant,
}

/// A request that got no answer to relay (a failed dispatch, or a node's error answer),
/// and the node that failed it, if one was tried.
pub struct Unanswered {
    pub error: ApiError,
    pub upstream: Option<Arc<Node>>,
    /// Whether a node may have received the request (and run it): false when none was
    /// reached, a connection could not be made, or the node answered 503 at once.
    pub sent: bool,
}

/// How long a non-streaming request may wait for its answer.
#[derive(Clone, Copy)]
pub struct Window(pub Option<Duration>);

/// Sends `body` to a node of `model` (the prefix's owner when `affinity` has one and
/// it is not overloaded); the node is counted in flight in `settlement`.
pub async fn dispatch(
    state: &AppState,
    model: &Model,
    body: Bytes,
    affinity: Affinity,
    settlement: &mut Settlement,
    window: Window,
) -> Result<Dispatched, Unanswered> {
    let mut failed: Option<(Arc<Node>, ApiError)> = None;
    // Whether a node may have received the request: see [`Unanswered::sent`].
    let mut reached = false;
    // One window for the request, failover included.
    let deadline = window.0.map(|w| tokio::time::Instant::now() + w);
    loop {
        let exclude = failed.as_ref().map(|(u, _)| u);
        let waiting = Instant::now();
        let taken = tokio::select! {
            taken = model.acquire(exclude, affinity, settlement.turn()).instrument(tracing::debug_span!("route")) => taken,
            () = state.draining().cancelled() => {
                return Err(Unanswered {
                    error: super::cut::shutting_down(),
                    upstream: failed.map(|(u, _)| u),
                    sent: reached,
                });
            }
        };
        settlement.record().add_queue_wait(waiting.elapsed());
        let taken = match taken {
            Ok(taken) => {
                // Once per request: a failover's pick is not a routing decision of its own.
                if failed.is_none() {
                    state.metrics().routed(&model.id, taken.decision);
                }
                taken
            }
            Err(no_node) => {
                // After a failover attempt, the first node's failure says more than
                // "no other node".
                let (error, upstream) = match failed {
                    Some((upstream, error)) if no_node == NoNode::NoneUp => (error, Some(upstream)),
                    Some((upstream, _)) => (no_node.into_error(&model.id), Some(upstream)),
                    None => (no_node.into_error(&model.id), None),
                };
                return Err(Unanswered {
                    error,
                    upstream,
                    sent: reached,
                });
            }
        };
        let upstream = Arc::clone(taken.in_flight.upstream());
        let metrics = state.metrics().upstream(&model.id, &upstream.gpu);
        settlement.hold_in_flight(taken, metrics.clone());
        let lost = upstream.lost();
        if lost.is_cancelled() {
            // Found dead between the pick and now: never sent, so another node may run
            // it (once, like any failover).
            if failed.is_some() {
                return Err(Unanswered {
                    error: stopped_answering(),
                    upstream: Some(upstream),
                    sent: reached,
                });
            }
            failed = Some((upstream, stopped_answering()));
            continue;
        }
        // The node's label, not its URL: the same name the client sees.
        let span = tracing::debug_span!(
            "upstream",
            gpu = %upstream.gpu,
            status = tracing::field::Empty,
        );
        let trace_headers = if state.config().traces.enabled() {
            traces::trace_headers(&span)
        } else {
            HeaderMap::new()
        };
        let sent = Instant::now();
        let call = state
            .upstream()
            .send_completion(&upstream.url, body.clone(), &trace_headers)
            .instrument(span.clone());
        let answer = tokio::select! {
            answer = within(deadline, call) => answer,
            () = lost.cancelled() => {
                metrics.outcome(UpstreamOutcome::Unreachable);
                return Err(Unanswered {
                    error: stopped_answering(),
                    upstream: Some(upstream),
                    sent: true,
                });
            }
        };
        if let Some(Ok(response)) = &answer {
            span.record("status", i64::from(response.status().as_u16()));
        }
        let never_started = match answer {
            None => {
                // Dropping the call closed its connection: vLLM aborts the generation.
                metrics.outcome(UpstreamOutcome::Deadline);
                let window_secs = window.0.map_or(0, |w| w.as_secs());
                tracing::warn!(model = %model.id, gpu = %upstream.gpu, window_secs, "upstream overran the request window");
                return Err(Unanswered {
                    error: ApiError::UpstreamDeadline { window_secs },
                    upstream: Some(upstream),
                    sent: true,
                });
            }
            Some(Err(err)) => {
                metrics.outcome(UpstreamOutcome::Unreachable);
                reached |= !err.never_sent();
                ApiError::from(err)
            }
            Some(Ok(response)) if response.status() == StatusCode::SERVICE_UNAVAILABLE => {
                metrics.outcome(UpstreamOutcome::ErrorStatus);
                upstream_rejection(response).await
            }
            Some(Ok(response)) => {
                if response.status().is_server_error() {
                    eject(state, model, &upstream);
                } else {
                    upstream.health.request_succeeded();
                }
                return Ok(Dispatched {
                    response,
                    upstream,
                    metrics,
                    sent,
                });
            }
        };
        eject(state, model, &upstream);
        if failed.is_some() {
            return Err(Unanswered {
                error: never_started,
                upstream: Some(upstream),
                sent: reached,
            });
        }
        tracing::info!(model = %model.id, gpu = %upstream.gpu, "request never started on the node; failing over");
        failed = Some((upstream, never_started));
    }
}

/// 502: the node was found dead (a failed probe) while the request was on it.
pub fn stopped_answering() -> ApiError {
    ApiError::UpstreamRejected {
        status: StatusCode::BAD_GATEWAY,
        kind: "upstream_error",
        message: "The model server stopped answering. Retry shortly.".into(),
    }
}

/// Runs `call` until the deadline, if there is one; `None` when it ran out.
async fn within<T>(
    deadline: Option<tokio::time::Instant>,
    call: impl Future<Output = T>,
) -> Option<T> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, call).await.ok(),
        None => Some(call.await),
    }
}

/// Takes a node that failed a request out of rotation, unless it is the model's last
/// node in rotation: with no other node to send to, ejecting it would only turn its
/// failures into refusals. The prober ejects a last node that is really down.
pub fn eject(state: &AppState, model: &Model, upstream: &Node) {
    let others_up = model
        .nodes()
        .iter()
        .any(|u| !std::ptr::eq(&**u, upstream) && u.health.is_up());
    if others_up && upstream.health.request_failed() {
        tracing::warn!(model = %model.id, gpu = %upstream.gpu, "node failed a request; ejected");
        state.metrics().upstream(&model.id, &upstream.gpu).ejected();
    }
}
