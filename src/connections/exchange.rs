//! One HTTP/1 request and its response, served by a hyper connection of its own (see
//! `client.rs`): when its answer is out (the connection is then told to end, so that
//! hyper hands the socket back), and whether the client connection may carry another
//! request: the client wants it kept alive, and the request's body was read to its end
//! (bytes of a body left unread must never be taken for the next request's head).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, Response, Version, header};
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Notify;
use tower_http::add_extension::AddExtension;

/// The router, with the client's address in every request's extensions.
pub(super) type Routed = TowerToHyperService<AddExtension<Router, ConnectInfo<SocketAddr>>>;

pub(super) fn routed(router: Router, remote: SocketAddr) -> Routed {
    TowerToHyperService::new(AddExtension::new(router, ConnectInfo(remote)))
}

/// What one exchange on a connection showed.
#[derive(Default)]
pub(super) struct Exchange {
    /// A request head arrived whole and went to the router.
    started: AtomicBool,
    /// The client asked to keep the connection (HTTP/1.1 without `Connection: close`).
    keep_alive: AtomicBool,
    /// The request's body was read to its end (or it had none).
    body_read: AtomicBool,
    /// hyper is done with the response (it dropped the body: the head is written, and
    /// the body too unless the connection failed).
    answered: Notify,
}

impl Exchange {
    pub(super) fn started(&self) -> bool {
        self.started.load(Ordering::Acquire)
    }

    /// Whether the connection may carry another request after this one.
    pub(super) fn reusable(&self) -> bool {
        self.started()
            && self.keep_alive.load(Ordering::Acquire)
            && self.body_read.load(Ordering::Acquire)
    }

    /// Resolves once the response is out (at once if it already is).
    pub(super) async fn answered(&self) {
        self.answered.notified().await;
    }

    fn begin(&self, request: &Request<Incoming>) {
        self.keep_alive
            .store(wants_keep_alive(request), Ordering::Release);
        if hyper::body::Body::is_end_stream(request.body()) {
            self.body_read.store(true, Ordering::Release);
        }
        self.started.store(true, Ordering::Release);
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

/// The router as one exchange's hyper service: notes the request in [`Exchange`], and
/// tracks its body and its response's.
pub(super) struct ExchangeService {
    pub(super) routed: Routed,
    pub(super) exchange: Arc<Exchange>,
}

impl hyper::service::Service<Request<Incoming>> for ExchangeService {
    type Response = Response<Body>;
    type Error = Infallible;
    /// Boxed: hyper hands the socket back only with a service future that is `Unpin`.
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        self.exchange.begin(&request);
        let exchange = Arc::clone(&self.exchange);
        let request = request.map(|body| {
            Body::new(TrackedBody {
                body,
                exchange: Arc::clone(&exchange),
            })
        });
        let answer = hyper::service::Service::call(&self.routed, request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| Body::new(AnsweredBody { body, exchange })))
        })
    }
}

/// A response body that tells its [`Exchange`] when hyper drops it.
struct AnsweredBody {
    body: Body,
    exchange: Arc<Exchange>,
}

impl Drop for AnsweredBody {
    fn drop(&mut self) {
        self.exchange.answered.notify_one();
    }
}

impl hyper::body::Body for AnsweredBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body that notes in its [`Exchange`] when it has been read to its end.
struct TrackedBody {
    body: Incoming,
    exchange: Arc<Exchange>,
}

impl TrackedBody {
    fn note_if_ended(&self) {
        if hyper::body::Body::is_end_stream(&self.body) {
            self.exchange.body_read.store(true, Ordering::Release);
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
            Poll::Ready(None) => self.exchange.body_read.store(true, Ordering::Release),
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
