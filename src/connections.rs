//! Client connections: accepted up to `connections.max_open`, served as HTTP/1.1 or
//! HTTP/2 (prior knowledge), each request head due within
//! `connections.header_read_timeout_ms` and at most [`MAX_HEAD_BYTES`] long, and closed
//! gracefully on shutdown.
//!
//! A client cannot hold a socket, a task and memory for as long as it likes: a
//! connection beyond the cap is closed as soon as it is accepted; one that sends its
//! request head too slowly, or nothing at all, is closed when the head is due (the same
//! timer closes an HTTP/1 keep-alive connection that stays idle that long); a head over
//! 16 KiB or 100 header lines gets 431 (from hyper, or in HTTP/2 from h2); a body that
//! trickles in gets 408 from the body reader (`http/body.rs`).
//!
//! An HTTP/1 request head hyper cannot parse (400) or that is over the limits (431) is
//! answered by hyper itself, before there is a request for the router to give an id
//! and an envelope to; [`HeadErrors`] puts the envelope, with an id of its own, in place
//! of hyper's bare answer (`head_errors.rs`). HTTP/2's equivalents are h2's own: a bare
//! 431 and a stream reset for a header list over the limit, a reset or GOAWAY with no
//! response for a malformed one.
//!
//! Each refusal is counted in `fleetgate_connection_refusals_total` and logged: one line
//! a second with the counts while there are any, so that a flood of them cannot flood
//! the log too. Nothing a client sent is logged.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower_http::add_extension::AddExtension;

use crate::config::ConnectionSettings;
use crate::metrics::{ConnectionRefusal, Metrics};

mod head_errors;

use head_errors::{HeadErrors, MAX_HEAD_BYTES};

/// After a failed `accept` (e.g. out of file descriptors), wait this long before the
/// next, instead of spinning.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// Refusals are logged as counts at most this often.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(1);

/// Serves `router` on `listener` until `stop` resolves; then accepts no more
/// connections, lets every open one finish the requests it has (HTTP/1 connections
/// close after their current response, HTTP/2 ones get a GOAWAY), and returns once all
/// are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    settings: &ConnectionSettings,
    metrics: Metrics,
    stop: impl Future<Output = ()>,
) {
    let head_due = Duration::from_millis(settings.header_read_timeout_ms);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(head_due)
        .max_buf_size(MAX_HEAD_BYTES);
    // HTTP/2 counts each header's name and value plus 32 bytes (RFC 9113 6.5.2).
    builder.http2().max_header_list_size(MAX_HEAD_BYTES as u32);
    let slots = Arc::new(Semaphore::new(settings.max_open));
    let graceful = GracefulShutdown::new();
    let refusals = Arc::new(Refusals::new(metrics.clone()));
    let mut log_refusals = tokio::time::interval(REFUSAL_LOG_EVERY);
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = log_refusals.tick() => {
                refusals.log();
                continue;
            }
            () = &mut stop => break,
        };
        let (tcp, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(error = %err, "could not accept a connection");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            drop(tcp);
            refusals.note(ConnectionRefusal::MaxOpen);
            continue;
        };
        // Without TCP_NODELAY a streamed response's small writes (headers, then each
        // chunk) wait on the client's delayed ACK: ~40 ms added to every request.
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::warn!(error = %err, "could not set TCP_NODELAY");
        }
        let service = TowerToHyperService::new(AddExtension::new(
            router.clone(),
            ConnectInfo::<SocketAddr>(remote),
        ));
        let connection = builder
            .serve_connection(
                TokioIo::new(HeadErrors::new(FirstBytesDue::new(tcp, head_due))),
                service,
            )
            .into_owned();
        let connection = graceful.watch(connection);
        let (metrics, refusals) = (metrics.clone(), Arc::clone(&refusals));
        // Not a tracked task: `graceful` watches the connection, and shutdown waits
        // for it below.
        tokio::spawn(async move {
            let _open = metrics.connection_open();
            if let Err(err) = connection.await {
                match refusal(err.as_ref()) {
                    Some(refusal) => refusals.note(refusal),
                    None => tracing::debug!(error = %err, "client connection ended with an error"),
                }
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    refusals.log();
}

/// Why the connection was closed without a whole request, if it was: a request head
/// not read in time (by hyper's timer, or by [`FirstBytesDue`] before hyper knew the
/// protocol), or one hyper could not parse (answered by hyper, see [`HeadErrors`]).
fn refusal(err: &(dyn std::error::Error + 'static)) -> Option<ConnectionRefusal> {
    std::iter::successors(Some(err), |e| e.source()).find_map(|e| {
        if let Some(err) = e.downcast_ref::<hyper::Error>() {
            if err.is_timeout() {
                return Some(ConnectionRefusal::HeaderTimeout);
            }
            if err.is_parse_too_large() {
                return Some(ConnectionRefusal::HeadTooLarge);
            }
            if err.is_parse() {
                return Some(ConnectionRefusal::MalformedHead);
            }
        }
        e.downcast_ref::<io::Error>()
            .filter(|e| e.kind() == io::ErrorKind::TimedOut)
            .map(|_| ConnectionRefusal::HeaderTimeout)
    })
}

/// How many bytes decide the protocol: HTTP/2's connection preface is 24 bytes long.
const PROTOCOL_BYTES: usize = 24;

/// A client socket whose first [`PROTOCOL_BYTES`] must arrive before a deadline. hyper
/// times the request head only once it knows the protocol, so without this a client
/// that sends nothing (or a few bytes) would hold its connection for ever; after them,
/// hyper's own header timer has started and this gets out of the way.
struct FirstBytesDue {
    tcp: TcpStream,
    /// Bytes still to come before the deadline no longer applies.
    awaited: usize,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl FirstBytesDue {
    fn new(tcp: TcpStream, within: Duration) -> Self {
        Self {
            tcp,
            awaited: PROTOCOL_BYTES,
            deadline: Box::pin(tokio::time::sleep(within)),
        }
    }
}

impl AsyncRead for FirstBytesDue {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.tcp).poll_read(cx, buf);
        if self.awaited == 0 {
            return read;
        }
        match read {
            Poll::Ready(Ok(())) => {
                let got = buf.filled().len() - before;
                self.awaited = self.awaited.saturating_sub(got);
                Poll::Ready(Ok(()))
            }
            Poll::Pending if self.deadline.as_mut().poll(cx).is_ready() => Poll::Ready(Err(
                io::Error::new(io::ErrorKind::TimedOut, "no request head in time"),
            )),
            other => other,
        }
    }
}

impl AsyncWrite for FirstBytesDue {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// Refused connections: counted in `/metrics` at once, and in the log as the counts
/// since the last line.
struct Refusals {
    metrics: Metrics,
    max_open: AtomicU64,
    header_timeout: AtomicU64,
    malformed_head: AtomicU64,
    head_too_large: AtomicU64,
}

impl Refusals {
    fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            max_open: AtomicU64::new(0),
            header_timeout: AtomicU64::new(0),
            malformed_head: AtomicU64::new(0),
            head_too_large: AtomicU64::new(0),
        }
    }

    fn note(&self, refusal: ConnectionRefusal) {
        self.metrics.connection_refused(refusal);
        match refusal {
            ConnectionRefusal::MaxOpen => &self.max_open,
            ConnectionRefusal::HeaderTimeout => &self.header_timeout,
            ConnectionRefusal::MalformedHead => &self.malformed_head,
            ConnectionRefusal::HeadTooLarge => &self.head_too_large,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// One line with the counts since the last one, if there were any. Never anything
    /// the client sent.
    fn log(&self) {
        let max_open = self.max_open.swap(0, Ordering::Relaxed);
        let header_timeout = self.header_timeout.swap(0, Ordering::Relaxed);
        let malformed_head = self.malformed_head.swap(0, Ordering::Relaxed);
        let head_too_large = self.head_too_large.swap(0, Ordering::Relaxed);
        if max_open + header_timeout + malformed_head + head_too_large > 0 {
            tracing::warn!(
                max_open,
                header_timeout,
                malformed_head,
                head_too_large,
                "client connections refused (max_open: the connection cap was reached; header_timeout: no complete request head in time; malformed_head: a request head that could not be parsed, answered 400; head_too_large: a request head over the limits, answered 431)"
            );
        }
    }
}
