//! Relaying the upstream's answer: status and body pass through byte for byte and
//! unbuffered (SSE frames are forwarded as they complete), metered on the way; an
//! error status is wrapped in our envelope instead. The request's slot is held until
//! the last byte is relayed or the client goes away.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use axum::body::Body;
use axum::http::header;
use axum::response::Response;
use bytes::Bytes;
use futures_util::{Stream, TryStreamExt};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::completion::meter::Meter;
use crate::completion::settle::Settlement;
use crate::error::ApiError;
use crate::metrics::{UpstreamMetrics, UpstreamOutcome};
use crate::upstream::upstream_rejection;

/// Response headers worth keeping from the upstream; everything else is hop-by-hop or
/// the upstream server's own business. (Content-Length is not kept: dropping the
/// usage frame of a stream changes the length.)
const KEPT_HEADERS: [header::HeaderName; 1] = [header::CONTENT_TYPE];

/// Resolves, with the reason, when a relayed body must be cut short.
pub type Cut = Pin<Box<dyn Future<Output = &'static str> + Send>>;

/// Cut when fleetgate's shutdown grace period is over (`draining`) or the node is
/// found dead (`lost`).
pub fn cut(draining: CancellationToken, lost: CancellationToken) -> Cut {
    Box::pin(async move {
        tokio::select! {
            () = draining.cancelled_owned() => "fleetgate is shutting down",
            () = lost.cancelled_owned() => "the model server stopped answering",
        }
    })
}

/// `forward_usage`: whether the client asked for a stream's usage-only frame.
/// `timing`: the upstream's series, for its outcome, time to the first byte and duration.
pub async fn relay(
    upstream: reqwest::Response,
    mut settlement: Settlement,
    forward_usage: bool,
    timing: Timing,
    cut: Cut,
) -> Result<Response, ApiError> {
    if !upstream.status().is_success() {
        timing.metrics.outcome(UpstreamOutcome::ErrorStatus);
        let rejection = upstream_rejection(upstream).await;
        settlement.release_unused().await;
        return Err(rejection);
    }
    timing.metrics.outcome(UpstreamOutcome::Ok);
    let is_sse = upstream
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    settlement.meter = if is_sse {
        Meter::sse(forward_usage)
    } else {
        Meter::json()
    };
    let mut response = Response::builder().status(upstream.status());
    for name in KEPT_HEADERS {
        if let Some(value) = upstream.headers().get(&name) {
            response = response.header(&name, value);
        }
    }
    // Dropping this body (the client went away) drops the upstream response, which
    // closes its connection, and vLLM aborts the generation; the settlement charges
    // what was relayed so far.
    let body = Metered {
        inner: Box::pin(upstream.bytes_stream().map_err(io::Error::other)),
        settlement,
        rest: None,
        settling: None,
        ended: false,
        timing,
        first_seen: false,
        cut,
    };
    response
        .body(Body::from_stream(body))
        .map_err(ApiError::internal)
}

type ByteStream = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;

struct Metered {
    inner: ByteStream,
    settlement: Settlement,
    /// Bytes still to send once the upstream has ended.
    rest: Option<Bytes>,
    /// The settlement under way: the body ends only after it, so a client that has the
    /// whole answer finds its slot free and its usage counted.
    settling: Option<JoinHandle<()>>,
    ended: bool,
    timing: Timing,
    first_seen: bool,
    cut: Cut,
}

/// The upstream's series and when the request was sent to it, for the time to its
/// first body byte and to its end.
pub struct Timing {
    pub metrics: UpstreamMetrics,
    pub sent: Instant,
}

impl Stream for Metered {
    type Item = io::Result<Bytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(rest) = this.rest.take() {
                return Poll::Ready(Some(Ok(rest)));
            }
            if let Some(settling) = this.settling.as_mut() {
                // A failed settlement task has logged its error; the body ends either way.
                let _ = ready!(Pin::new(settling).poll(cx));
                this.settling = None;
            }
            if this.ended {
                return Poll::Ready(None);
            }
            if let Poll::Ready(reason) = this.cut.as_mut().poll(cx) {
                this.ended = true;
                this.settling = this.settlement.settle();
                return Poll::Ready(Some(Err(io::Error::other(reason))));
            }
            match ready!(this.inner.as_mut().poll_next(cx)) {
                Some(Ok(chunk)) => {
                    if !std::mem::replace(&mut this.first_seen, true) {
                        this.timing.metrics.first_byte(this.timing.sent);
                    }
                    let out = this.settlement.meter.feed(chunk);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                Some(Err(err)) => {
                    this.ended = true;
                    this.settling = this.settlement.settle();
                    return Poll::Ready(Some(Err(err)));
                }
                None => {
                    this.ended = true;
                    this.timing.metrics.finished(this.timing.sent);
                    let rest = this.settlement.meter.finish();
                    this.rest = (!rest.is_empty()).then_some(rest);
                    this.settling = this.settlement.settle();
                }
            }
        }
    }
}
