//! The requests one hyper HTTP/1 connection serves (see `client.rs`): whether it is
//! quiet (every request it began has its answer's head out), whether anything happened
//! since a given moment, and whether the client connection may carry another request
//! once hyper gives it back: the last request asked to keep it, and its body was read
//! to its end (bytes of a body left unread must never be taken for a request's head).
//! An answer given before its request's body was read to its end (a 413 from
//! `Content-Length`, a route that takes no body) says `Connection: close`, since the
//! connection closes after it: a client must not send its next request on it.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, Version, header};
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::service::TowerToHyperService;
use tower_http::add_extension::AddExtension;
use tower_http::compression::{Compression, CompressionBody};

use crate::http::router::{CompressWhen, compressed};

/// The router, with the client's address in every request's extensions, and its
/// answers compressed (`router::compressed`).
pub(super) type Routed =
    TowerToHyperService<Compression<AddExtension<Router, ConnectInfo<SocketAddr>>, CompressWhen>>;

/// What hyper sends: the router's answer, compressed or not.
type Sent = Response<CompressionBody<Body>>;

pub(super) fn routed(router: Router, remote: SocketAddr) -> Routed {
    TowerToHyperService::new(compressed(AddExtension::new(router, ConnectInfo(remote))))
}

/// What the requests on one hyper connection showed.
#[derive(Default)]
pub(super) struct Exchanges {
    /// Requests whose head arrived whole and went to the router.
    begun: AtomicU64,
    /// Of those, how many have their answer handed to hyper (its head written at once).
    answered: AtomicU64,
    /// The last request asked to keep the connection.
    keep_alive: AtomicBool,
    /// The number of the last request whose body was read to its end (or had none).
    body_read: AtomicU64,
}

impl Exchanges {
    pub(super) fn begun(&self) -> u64 {
        self.begun.load(Ordering::Acquire)
    }

    /// Changes with every request begun and every answer.
    pub(super) fn events(&self) -> u64 {
        self.begun() + self.answered.load(Ordering::Acquire)
    }

    /// At least one request, and every one begun has its answer out.
    pub(super) fn quiet(&self) -> bool {
        let begun = self.begun();
        begun > 0 && self.answered.load(Ordering::Acquire) == begun
    }

    /// Whether the connection may carry another request after the last one.
    pub(super) fn reusable(&self) -> bool {
        let begun = self.begun();
        begun > 0
            && self.keep_alive.load(Ordering::Acquire)
            && self.body_read.load(Ordering::Acquire) == begun
    }

    /// Notes a request: its number.
    fn begin(&self, request: &Request<Incoming>) -> u64 {
        self.keep_alive
            .store(wants_keep_alive(request), Ordering::Release);
        let number = self.begun.fetch_add(1, Ordering::AcqRel) + 1;
        if hyper::body::Body::is_end_stream(request.body()) {
            self.body_read.store(number, Ordering::Release);
        }
        number
    }
}

/// Whether the client asked to keep the connection, as hyper reads it: HTTP/1.1 unless
/// it says `close`, HTTP/1.0 only when it says `keep-alive`.
fn wants_keep_alive(request: &Request<Incoming>) -> bool {
    let says = |token: &str| {
        request
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    };
    match request.version() {
        Version::HTTP_11 => !says("close"),
        Version::HTTP_10 => says("keep-alive") && !says("close"),
        _ => false,
    }
}

/// The router as one hyper connection's service: notes each request in [`Exchanges`],
/// and tracks its body and when its answer is out.
pub(super) struct ExchangeService {
    pub(super) routed: Routed,
    pub(super) exchanges: Arc<Exchanges>,
}

impl hyper::service::Service<Request<Incoming>> for ExchangeService {
    type Response = Sent;
    type Error = Infallible;
    /// Boxed: hyper hands the socket back only with a service future that is `Unpin`.
    type Future = Pin<Box<dyn Future<Output = Result<Sent, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let number = self.exchanges.begin(&request);
        let exchanges = Arc::clone(&self.exchanges);
        let request = request.map(|body| {
            Body::new(TrackedBody {
                body,
                number,
                exchanges: Arc::clone(&exchanges),
            })
        });
        let answer = hyper::service::Service::call(&self.routed, request);
        Box::pin(async move {
            let mut response = answer.await?;
            if exchanges.body_read.load(Ordering::Acquire) != number {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            exchanges.answered.fetch_add(1, Ordering::AcqRel);
            Ok(response)
        })
    }
}

/// A request body that notes in [`Exchanges`] when it has been read to its end.
struct TrackedBody {
    body: Incoming,
    /// Which request of the connection it is.
    number: u64,
    exchanges: Arc<Exchanges>,
}

impl TrackedBody {
    fn note_if_ended(&self) {
        if hyper::body::Body::is_end_stream(&self.body) {
            self.exchanges
                .body_read
                .store(self.number, Ordering::Release);
        }
    }
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                let number = self.number;
                self.exchanges.body_read.store(number, Ordering::Release);
            }
            Poll::Ready(Some(Ok(_))) => self.note_if_ended(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.body)
    }

    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.body)
    }
}
