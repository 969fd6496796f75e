//! One client connection, from its first bytes to its close.
//!
//! Its first bytes tell the protocol: HTTP/2's connection preface, or HTTP/1. Over
//! HTTPS these are the first bytes inside TLS, after the handshake; ALPN's choice is not
//! consulted (a client that chose h2 sends the preface), and the rest is the same.
//!
//! - **HTTP/2** is served by one hyper connection for the connection's life. One with
//!   no request under way for `header_read_timeout_ms` (from its accept, or from the end
//!   of its last request) gets a GOAWAY and is closed ([`Streams`]); and it is pinged
//!   when it has sent nothing for `header_read_timeout_ms`, and dropped if the ping is
//!   not answered within as long again: a peer gone silently holds nothing.
//! - **HTTP/1** is served by a hyper connection (keep-alive on) for as long as the client
//!   keeps it busy. Once it has been quiet for [`QUIET_AFTER`] after an answer, it is
//!   told to end and taken apart ([`Exchanges`]), and the socket waits for the next
//!   request holding no buffer; that request gets a new hyper connection. hyper's HTTP/1
//!   connection keeps a read and a write buffer for as long as it lives (about 30 kB once
//!   it has served a request), which made 10,000 idle keep-alive clients cost 370 MB.
//!   Bytes hyper read past its last answer (a pipelined request) go to the next one; a
//!   connection whose last request body was not read to its end, or that hyper ended
//!   itself (the client closed or asked to), is closed.
//!
//! HTTP/1 deadlines: a request head must begin within `header_read_timeout_ms` of the accept
//! or of the previous answer (an idle keep-alive connection is closed then), and a head
//! that has begun must be whole within `header_read_timeout_ms` (hyper's header timer).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use super::exchange::{ExchangeService, Exchanges, Routed};
use super::head_errors::{HeadErrors, MAX_HEAD_BYTES};
use super::prefixed::Prefixed;
use super::refusals::{Refusals, refusal};
use super::socket::Socket;
use super::streams::{StreamService, Streams};
use crate::metrics::{ConnectionRefusal, Metrics};

/// How long an HTTP/1 connection stays with hyper after its last answer. Clients that
/// send their next request sooner (load, batch jobs, pipelines) keep one hyper connection
/// for as long as they keep it busy; a connection quiet this long hands its socket back
/// and waits holding no buffers (a hyper connection costs ~30 kB of them).
const QUIET_AFTER: Duration = Duration::from_millis(250);

/// How long an idle HTTP/2 connection, sent its GOAWAY, may take to acknowledge it (the
/// ping h2 sends with it) before it is dropped: a round trip, with room to spare.
const GOAWAY_WAIT: Duration = Duration::from_secs(1);

/// How long a closing HTTP/1 connection reads (and drops) what the client still sends
/// after its last answer, at most: see [`linger`]. Long enough for a client on a busy
/// host to finish sending a body of some MiB and read the answer; a client can hold its
/// connection no longer this way than by trickling a body.
const LINGER: Duration = Duration::from_secs(5);

/// The first bytes of every HTTP/2 connection with prior knowledge (RFC 9113 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What every client connection is served with.
pub(super) struct Serving {
    pub(super) http1: http1::Builder,
    pub(super) http2: http2::Builder<TokioExecutor>,
    /// `connections.header_read_timeout_ms`.
    pub(super) head_due: Duration,
    pub(super) refusals: Arc<Refusals>,
    metrics: Metrics,
    /// Cancelled at shutdown: idle connections close, busy ones after their response.
    pub(super) stopping: CancellationToken,
}

impl Serving {
    pub(super) fn new(
        head_due: Duration,
        refusals: Arc<Refusals>,
        metrics: Metrics,
        stopping: CancellationToken,
    ) -> Self {
        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(head_due)
            .max_buf_size(MAX_HEAD_BYTES)
            // One buffer per write instead of a queue of pieces for `writev`: a paced
            // stream's frame is a few hundred bytes with its chunk line and CRLF, and
            // copying them costs less than the queue's bookkeeping (callgrind, 300-byte
            // frames: 6,995 -> 6,655 instructions a frame) and one iovec less than three
            // in the kernel; a fast stream's 16 KiB writes showed no difference.
            .writev(false);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        // HTTP/2 counts each header's name and value plus 32 bytes (RFC 9113 6.5.2).
        http2
            .timer(TokioTimer::new())
            .max_header_list_size(MAX_HEAD_BYTES as u32)
            // A ping after this long without a frame from the client, and the connection
            // dropped if it is not answered within as long again.
            .keep_alive_interval(Some(head_due))
            .keep_alive_timeout(head_due);
        Self {
            http1,
            http2,
            head_due,
            refusals,
            metrics,
            stopping,
        }
    }

    /// Serves `tcp` as plain HTTP until the client or the server closes it.
    pub(super) async fn serve(&self, tcp: TcpStream, routed: Routed) {
        let opened = Instant::now();
        // One wait for the whole connection (each new one takes a lock to register).
        let stopping = self.stopping.cancelled();
        tokio::pin!(stopping);
        self.serve_socket(tcp, opened, routed, stopping).await;
    }

    /// Serves `tcp` as HTTPS: the TLS handshake first, on this connection's own task (a
    /// slow one holds up no other), due with the first request head, within
    /// `header_read_timeout_ms` of the accept; then as plain HTTP is served.
    pub(super) async fn serve_tls(&self, tcp: TcpStream, tls: &TlsAcceptor, routed: Routed) {
        let opened = Instant::now();
        let stopping = self.stopping.cancelled();
        tokio::pin!(stopping);
        let handshake = tokio::select! {
            done = tokio::time::timeout_at(opened + self.head_due, tls.accept(tcp)) => done,
            () = stopping.as_mut() => return,
        };
        match handshake {
            Ok(Ok(stream)) => self.serve_socket(stream, opened, routed, stopping).await,
            Ok(Err(err)) => {
                // Not TLS, no version or cipher in common, or the client refused the
                // certificate: rustls's words say which, nothing the client sent.
                tracing::debug!(error = %err, "TLS handshake failed");
                self.refusals.note(ConnectionRefusal::TlsHandshake);
            }
            Err(_elapsed) => self.refusals.note(ConnectionRefusal::HeaderTimeout),
        }
    }

    /// Serves `tcp` (the socket, or TLS on it), accepted at `opened`, until the client
    /// or the server closes it.
    async fn serve_socket<S: Socket>(
        &self,
        mut tcp: S,
        opened: Instant,
        routed: Routed,
        mut stopping: Pin<&mut WaitForCancellationFuture<'_>>,
    ) {
        let head_due = opened + self.head_due;
        let first = tokio::select! {
            first = tokio::time::timeout_at(head_due, read_protocol(&mut tcp)) => first,
            () = stopping.as_mut() => return,
        };
        match first {
            Err(_elapsed) => self.refusals.note(ConnectionRefusal::HeaderTimeout),
            Ok(Err(_)) => {}
            Ok(Ok(first)) if first.is_empty() => {}
            Ok(Ok(first)) if first[..] == H2_PREFACE[..] => {
                self.serve_http2(tcp, first, opened, routed, stopping).await
            }
            Ok(Ok(first)) => {
                self.serve_http1(tcp, first, head_due, routed, stopping)
                    .await
            }
        }
    }

    /// `opened`: when the connection was accepted.
    async fn serve_http2<S: Socket>(
        &self,
        tcp: S,
        first: Bytes,
        opened: Instant,
        routed: Routed,
        mut stopping: Pin<&mut WaitForCancellationFuture<'_>>,
    ) {
        let streams = Arc::new(Streams::new(opened));
        let service = StreamService {
            routed,
            streams: Arc::clone(&streams),
        };
        let connection = self
            .http2
            .serve_connection(TokioIo::new(Prefixed::new(first, tcp)), service);
        tokio::pin!(connection);
        let idle_check = tokio::time::sleep_until(opened + self.head_due);
        tokio::pin!(idle_check);
        let ended = loop {
            tokio::select! {
                ended = connection.as_mut() => break ended,
                () = idle_check.as_mut() => match streams.idle_at(self.head_due) {
                    // No request for `head_due`: closed as an idle HTTP/1 connection is,
                    // with a GOAWAY first. Only a request begun in this very instant can
                    // be under way; like one racing an HTTP/1 idle close, it may be cut.
                    Some(idle) if idle <= Instant::now() => {
                        self.refusals.note(ConnectionRefusal::HeaderTimeout);
                        connection.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(GOAWAY_WAIT, connection.as_mut()).await;
                        return;
                    }
                    Some(idle) => idle_check.as_mut().reset(idle),
                    // Checked again once the requests under way could have ended.
                    None => idle_check.as_mut().reset(Instant::now() + self.head_due),
                },
                () = stopping.as_mut() => {
                    // A GOAWAY: the streams under way finish, no new one starts.
                    connection.as_mut().graceful_shutdown();
                    break connection.await;
                }
            }
        };
        // Not a refusal even when it timed out: that is a ping left unanswered (the
        // peer is gone), not a request head.
        if let Err(err) = ended {
            tracing::debug!(error = %err, "HTTP/2 client connection ended with an error");
        }
    }

    /// hyper connections one after another, each for as long as the client keeps it busy;
    /// `head_due`: when the next request head must have begun, once one is awaited.
    async fn serve_http1<S: Socket>(
        &self,
        mut tcp: S,
        mut unread: Bytes,
        mut head_due: Instant,
        routed: Routed,
        mut stopping: Pin<&mut WaitForCancellationFuture<'_>>,
    ) {
        loop {
            if unread.is_empty()
                && !self
                    .await_next_head(&tcp, head_due, stopping.as_mut())
                    .await
            {
                return;
            }
            let exchanges = Arc::new(Exchanges::default());
            let service = ExchangeService {
                routed: routed.clone(),
                exchanges: Arc::clone(&exchanges),
            };
            let io = TokioIo::new(HeadErrors::new(Prefixed::new(unread, tcp)));
            let mut connection = self.http1.serve_connection(io, service);
            let quiet_check = tokio::time::sleep(QUIET_AFTER);
            tokio::pin!(quiet_check);
            let mut events = exchanges.events();
            let mut quieted = false;
            let mut ending = false;
            let ended = loop {
                tokio::select! {
                    ended = std::future::poll_fn(|cx| connection.poll_without_shutdown(cx)) => {
                        break ended;
                    }
                    // Nothing begun or answered for QUIET_AFTER: the connection ends and
                    // gives the socket back, rather than wait for the next request with
                    // its buffers. (Keep-alive was on when its answers' heads went out,
                    // and nothing is under way: ending it adds no `Connection: close`.)
                    () = quiet_check.as_mut(), if !ending => {
                        let now = exchanges.events();
                        if now == events && exchanges.quiet() {
                            ending = true;
                            quieted = true;
                            Pin::new(&mut connection).graceful_shutdown();
                        } else {
                            events = now;
                            quiet_check.as_mut().reset(Instant::now() + QUIET_AFTER);
                        }
                    }
                    // A request under way is answered (with `Connection: close`), then
                    // the connection closes; one not begun closes now.
                    () = stopping.as_mut(), if !ending => {
                        if exchanges.begun() == 0 {
                            return;
                        }
                        ending = true;
                        Pin::new(&mut connection).graceful_shutdown();
                    }
                }
            };
            if let Err(err) = ended {
                return self.note_end(Err(err));
            }
            let parts = connection.into_parts();
            let (rest, socket) = parts.io.into_inner().into_inner().into_parts();
            tcp = socket;
            // Only a connection ended for quiet goes on: hyper ended any other because
            // the client closed or asked to, or the server is stopping.
            if !quieted || !exchanges.reusable() || self.stopping.is_cancelled() {
                return linger(tcp).await;
            }
            // What hyper read past the response first, then what it never read: copied
            // out, since hyper's read buffer (8 KiB, even when empty) must not stay with
            // the idle connection.
            unread = if parts.read_buf.is_empty() && rest.is_empty() {
                Bytes::new()
            } else {
                [parts.read_buf, rest].concat().into()
            };
            // It has been quiet for QUIET_AFTER since the answer already.
            head_due = Instant::now() + self.head_due.saturating_sub(QUIET_AFTER);
        }
    }

    /// Waits, holding no buffer, until the socket has something to read (the next
    /// request, or the client's close, which the next exchange then reads): `false` when
    /// the head is overdue (counted as a refusal) or the server is stopping.
    async fn await_next_head<S: Socket>(
        &self,
        tcp: &S,
        head_due: Instant,
        stopping: Pin<&mut WaitForCancellationFuture<'_>>,
    ) -> bool {
        let _idle = self.metrics.connection_idle();
        tokio::select! {
            ready = tokio::time::timeout_at(head_due, tcp.readable()) => match ready {
                Ok(Ok(())) => true,
                Ok(Err(_)) => false,
                Err(_elapsed) => {
                    self.refusals.note(ConnectionRefusal::HeaderTimeout);
                    false
                }
            },
            () = stopping => false,
        }
    }

    fn note_end(&self, ended: Result<(), hyper::Error>) {
        if let Err(err) = ended {
            match refusal(&err) {
                Some(refusal) => self.refusals.note(refusal),
                None => tracing::debug!(error = %err, "client connection ended with an error"),
            }
        }
    }
}

/// Closes a connection after its last answer: the answer is followed by the end of the
/// stream at once, and what the client still sends is read and dropped until it closes
/// too, for at most [`LINGER`]. Closed with bytes unread, the socket would be reset, and
/// a client still sending a body the answer refused (a 413 given from `Content-Length`)
/// would get a broken pipe instead of the answer.
async fn linger<S: Socket>(mut tcp: S) {
    if tcp.shutdown().await.is_ok() {
        let mut sink = tokio::io::sink();
        let _ = tokio::time::timeout(LINGER, tokio::io::copy(&mut tcp, &mut sink)).await;
    }
}

/// Reads the connection's first bytes, as many as tell HTTP/2's preface from anything
/// else (at most 24): empty when the client closed before sending any.
async fn read_protocol<S: Socket>(tcp: &mut S) -> io::Result<Bytes> {
    let mut first = [0u8; H2_PREFACE.len()];
    let mut n = 0;
    while n < first.len() && first[..n] == H2_PREFACE[..n] {
        let got = tcp.read(&mut first[n..]).await?;
        if got == 0 {
            break;
        }
        n += got;
    }
    Ok(Bytes::copy_from_slice(&first[..n]))
}
