//! The requests under way on one HTTP/2 connection (see `client.rs`), and since when
//! there have been none: a connection with no request under way for
//! `header_read_timeout_ms` is closed, as an idle HTTP/1 one is. hyper's HTTP/2 server
//! has no such timer of its own, so without this a client that sent its preface and
//! then nothing would hold its socket for as long as it liked.
//!
//! A request is under way from the moment its head reaches the router until its
//! answer's body is dropped (sent to its end, or the stream reset).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::Instant;
use tower_http::compression::CompressionBody;

use super::exchange::Routed;

/// What one HTTP/2 connection's requests showed.
pub(super) struct Streams {
    /// When the connection was accepted; the time below is counted from it.
    opened: Instant,
    under_way: AtomicUsize,
    /// Milliseconds from `opened` to the end of the last request (0 before the first).
    last_end_ms: AtomicU64,
}

impl Streams {
    pub(super) fn new(opened: Instant) -> Self {
        Self {
            opened,
            under_way: AtomicUsize::new(0),
            last_end_ms: AtomicU64::new(0),
        }
    }

    /// When the connection has been without a request for `idle`; `None` while one is
    /// under way.
    pub(super) fn idle_at(&self, idle: Duration) -> Option<Instant> {
        if self.under_way.load(Ordering::Acquire) > 0 {
            return None;
        }
        let last_end = Duration::from_millis(self.last_end_ms.load(Ordering::Acquire));
        Some(self.opened + last_end + idle)
    }
}

/// One request counted under way until dropped.
struct UnderWay(Arc<Streams>);

impl UnderWay {
    fn begin(streams: &Arc<Streams>) -> Self {
        streams.under_way.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(streams))
    }
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        let streams = &self.0;
        // The end first: a check that sees none under way must see when the last ended.
        let ended = u64::try_from(streams.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        streams.last_end_ms.fetch_max(ended, Ordering::AcqRel);
        streams.under_way.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The router as one HTTP/2 connection's service: each request counted in [`Streams`]
/// until its answer's body is dropped.
pub(super) struct StreamService {
    pub(super) routed: Routed,
    pub(super) streams: Arc<Streams>,
}

impl hyper::service::Service<Request<Incoming>> for StreamService {
    type Response = Response<Counted<CompressionBody<axum::body::Body>>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        // Dropped with the future if the stream is reset before the answer.
        let under_way = UnderWay::begin(&self.streams);
        let answer = hyper::service::Service::call(&self.routed, request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| Counted {
                body,
                _under_way: under_way,
            }))
        })
    }
}

/// An answer's body that keeps its request counted under way until dropped.
pub(super) struct Counted<B> {
    body: B,
    _under_way: UnderWay,
}

impl<B: Body + Unpin> Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
