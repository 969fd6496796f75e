//! Relaying the upstream's answer: status and body pass through byte for byte,
//! metered on the way; an error status is wrapped in our envelope instead. The
//! request's slot is held until the last byte is relayed or the client goes away.
//!
//! - A stream (and any large or unsized body) is relayed unbuffered: what the upstream
//!   has delivered goes out in one write, cut after the last complete SSE frame, so a
//!   fast stream costs one write per read from the upstream, not one per frame.
//! - A small JSON answer (a `Content-Length` of at most [`WHOLE_BODY_MAX`]) is read
//!   whole first, settled, and sent in one write with its length: the client cannot use
//!   half a JSON body, and it gets the answer only once its slot is free.
//! - A stream whose node generates past what the request allows is cut there (the
//!   settlement charges at most the reservation and ejects the node).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, StatusCode};

use super::cut::Cut;
use super::dispatch::stopped_answering;
use super::meter::Meter;
use super::settle::{Settlement, Settling};
use super::watch::Watch;
use crate::error::ApiError;
use crate::metrics::{UpstreamMetrics, UpstreamOutcome};
use crate::upstream::{ByteStream, NodeReply, upstream_rejection};

/// A JSON answer up to this long is read whole before it is relayed.
const WHOLE_BODY_MAX: u64 = 64 * 1024;
/// Bytes the upstream has delivered are relayed together, up to this many: a fast
/// stream goes out in writes of this size rather than one per frame, and a gather never
/// holds bytes back for long waiting for more reads to fill it.
const GATHER_MAX: usize = 16 * 1024;
/// Room for a gather: up to [`GATHER_MAX`] and the piece that crosses it (an SSE frame,
/// a few hundred bytes, or a few KiB with logprobs).
const GATHER_ROOM: usize = GATHER_MAX + 4 * 1024;
/// A node's success answer on its way to the client: its status and content type kept,
/// its body metered.
pub struct Relayed {
    pub status: StatusCode,
    pub content_type: Option<HeaderValue>,
    pub body: RelayedBody,
}

#[expect(
    clippy::large_enum_variant,
    reason = "as for `Answer`: a stream's body is boxed once, by the front door"
)]
pub enum RelayedBody {
    /// A small JSON answer, read whole and settled.
    Whole(Bytes),
    /// A stream (or a large or unsized body), metered as it is relayed and settled when
    /// it ends.
    Streamed(Metered),
}

impl RelayedBody {
    /// The next piece for the client; `None` at the end. An error means the answer was
    /// cut short (the node stopped answering, or fleetgate is shutting down).
    pub async fn next_piece(&mut self) -> Option<io::Result<Bytes>> {
        match self {
            Self::Whole(bytes) if bytes.is_empty() => None,
            Self::Whole(bytes) => Some(Ok(std::mem::take(bytes))),
            Self::Streamed(metered) => std::future::poll_fn(|cx| metered.poll_piece(cx)).await,
        }
    }
}

/// `forward_usage`: whether the client asked for a stream's usage-only frame.
/// `timing`: the upstream's series, for its outcome, time to the first byte and duration.
/// `span`: the relay's trace span, which a streamed body holds until it ends.
pub async fn relay(
    upstream: NodeReply,
    mut settlement: Settlement,
    forward_usage: bool,
    timing: Timing,
    cut: Cut,
    span: tracing::Span,
) -> Result<Relayed, ApiError> {
    if !upstream.status().is_success() {
        timing.metrics.outcome(UpstreamOutcome::ErrorStatus);
        let rejection = upstream_rejection(upstream).await;
        settlement.release_unused().await;
        return Err(rejection);
    }
    timing.metrics.outcome(UpstreamOutcome::Ok);
    // Of the upstream's headers only the content type is kept: the others are
    // hop-by-hop or the node's own business, and a stream's length changes when its
    // usage frame is dropped (a whole body gets its length from the relay).
    let content_type = upstream.content_type().cloned();
    let is_sse = content_type
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    settlement.meter = if is_sse {
        Meter::sse(forward_usage, GATHER_ROOM)
    } else {
        Meter::json()
    };
    let status = upstream.status();
    if !is_sse
        && upstream
            .content_length()
            .is_some_and(|n| n <= WHOLE_BODY_MAX)
    {
        let body = relay_whole(upstream, settlement, timing, cut).await?;
        return Ok(Relayed {
            status,
            content_type,
            body: RelayedBody::Whole(body),
        });
    }
    // Dropping this body (the client went away) drops the upstream response, which
    // closes its connection, and vLLM aborts the generation; the settlement charges
    // what was relayed so far.
    let body = Metered {
        inner: Watch::new(upstream.into_body()),
        settlement,
        rest: None,
        settling: None,
        end: None,
        yielded: false,
        first_out: FirstOut::Ahead,
        ended: false,
        timing,
        first_seen: false,
        cut: Watch::new(cut),
        _span: span,
    };
    Ok(Relayed {
        status,
        content_type,
        body: RelayedBody::Streamed(body),
    })
}

/// Reads a small answer whole and settles. An answer that stops before its length is a
/// 502 with the envelope, since nothing was sent yet.
async fn relay_whole(
    upstream: NodeReply,
    mut settlement: Settlement,
    timing: Timing,
    cut: Cut,
) -> Result<Bytes, ApiError> {
    let mut body = upstream.into_body();
    let read = async {
        while let Some(chunk) = body.next().await {
            settlement
                .meter
                .push(chunk.map_err(|_| stopped_answering())?);
        }
        Ok(())
    };
    let read = tokio::select! {
        read = read => read,
        reason = cut => Err(cut_short(reason)),
    };
    if let Err(err) = read {
        settlement.finish().await;
        return Err(err);
    }
    timing.metrics.first_byte(timing.sent);
    timing.metrics.finished(timing.sent);
    let body = settlement.meter.take();
    settlement.finish().await;
    Ok(body)
}

/// 502: a [`Cut`] stopped the answer before any of it was sent.
fn cut_short(reason: &str) -> ApiError {
    ApiError::UpstreamRejected {
        status: http::StatusCode::BAD_GATEWAY,
        kind: "upstream_error",
        message: format!("The answer was cut short: {reason}. Retry shortly."),
    }
}

/// The first bytes relayed go out at once. hyper writes what it holds only when the
/// body has nothing more for it or its buffer is full (16 pieces), so a fast stream's
/// first frame would wait until up to 16 gathers of what follows had been read and
/// metered: the body yields once after its first piece, and hyper writes it.
#[derive(PartialEq)]
enum FirstOut {
    /// Nothing relayed yet.
    Ahead,
    /// The first piece is with hyper: the next poll yields.
    Handed,
    /// Yielded; hyper wrote it.
    Written,
}

/// A streamed answer's body: relayed piece by piece ([`Metered::poll_piece`]), metered
/// on the way, and settled when it ends or is dropped.
pub struct Metered {
    /// Polled again only once it may have more: hyper polls the body again after each
    /// piece, and at a realistic pace the upstream's answer to that is always `Pending`.
    inner: Watch<ByteStream>,
    settlement: Settlement,
    /// Bytes still to send once the upstream has ended.
    rest: Option<Bytes>,
    /// The settlement under way: the body ends only after it, so a client that has the
    /// whole answer finds its slot free and its usage counted.
    settling: Option<Settling>,
    /// How the upstream body ended (`Some(None)`: complete), when that was seen while
    /// gathering: acted on once the bytes before it are relayed.
    end: Option<Option<io::Error>>,
    /// Whether the body has yielded once before relaying an error seen while gathering.
    yielded: bool,
    first_out: FirstOut,
    ended: bool,
    timing: Timing,
    first_seen: bool,
    /// Looked at before each read from the upstream; polling the cut itself locks two
    /// cancellation tokens' mutexes, and a paced stream looks at every frame.
    cut: Watch<Cut>,
    /// Open while the body is relayed: the relay's span ends with the body, not when
    /// the response head goes out.
    _span: tracing::Span,
}

/// The upstream's series and when the request was sent to it, for the time to its
/// first body byte and to its end.
pub struct Timing {
    pub metrics: UpstreamMetrics,
    pub sent: Instant,
}

impl Metered {
    /// The next piece of the answer for the client; an error ends the body early (the
    /// front door then drops the connection).
    pub fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        if self.first_out == FirstOut::Handed {
            self.first_out = FirstOut::Written;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        loop {
            if let Some(rest) = self.rest.take() {
                return Poll::Ready(Some(Ok(rest)));
            }
            if let Some(settling) = self.settling.as_mut() {
                // A failed settlement has logged its error; the body ends either way.
                ready!(Pin::new(settling).poll(cx));
                self.settling = None;
            }
            if self.ended {
                return Poll::Ready(None);
            }
            if matches!(self.end, Some(Some(_))) && !std::mem::replace(&mut self.yielded, true) {
                // An error makes hyper drop the connection with whatever it still holds
                // unwritten: yield once, so the bytes relayed before it are written first.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let end = match self.end.take() {
                Some(end) => end,
                None => {
                    if let Poll::Ready(reason) = self.cut.poll_with(cx, |c, cx| c.as_mut().poll(cx))
                    {
                        return self.cut_short(reason);
                    }
                    match self.inner.poll_with(cx, |s, cx| s.as_mut().poll_next(cx)) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Some(Ok(chunk))) => {
                            if std::mem::replace(&mut self.first_seen, true) {
                                self.gather(chunk, cx);
                            } else {
                                // The first bytes go out at once: gathering would hold a
                                // fast stream's first frame until more had come.
                                self.timing.metrics.first_byte(self.timing.sent);
                                self.settlement.meter.push(chunk);
                            }
                            let out = self.settlement.meter.take();
                            if self.settlement.streamed_past_bound() {
                                // Cut at the bound: the frames past it are not relayed.
                                return self.cut_short("the node generated past max_tokens");
                            }
                            if !out.is_empty() {
                                if self.first_out == FirstOut::Ahead {
                                    self.first_out = FirstOut::Handed;
                                }
                                return Poll::Ready(Some(Ok(out)));
                            }
                            continue;
                        }
                        Poll::Ready(Some(Err(err))) => Some(err),
                        Poll::Ready(None) => None,
                    }
                }
            };
            self.ended = true;
            self.settling = self.settlement.settle();
            match end {
                Some(err) => return Poll::Ready(Some(Err(err))),
                None => {
                    self.timing.metrics.finished(self.timing.sent);
                    let rest = self.settlement.meter.finish();
                    self.rest = (!rest.is_empty()).then_some(rest);
                }
            }
        }
    }

    /// Ends the body with an error (hyper then drops the connection) and settles.
    fn cut_short(&mut self, reason: &'static str) -> Poll<Option<io::Result<Bytes>>> {
        self.ended = true;
        self.settling = self.settlement.settle();
        Poll::Ready(Some(Err(io::Error::other(reason))))
    }

    /// Meters `chunk` and whatever else the upstream has already delivered (up to
    /// [`GATHER_MAX`]), noting the body's end if it came too.
    fn gather(&mut self, chunk: Bytes, cx: &mut Context<'_>) {
        self.settlement.meter.push(chunk);
        while self.end.is_none() && self.settlement.meter.held() < GATHER_MAX {
            match self.inner.poll_with(cx, |s, cx| s.as_mut().poll_next(cx)) {
                Poll::Ready(Some(Ok(chunk))) => self.settlement.meter.push(chunk),
                Poll::Ready(Some(Err(err))) => self.end = Some(Some(err)),
                Poll::Ready(None) => self.end = Some(None),
                Poll::Pending => break,
            }
        }
    }
}
