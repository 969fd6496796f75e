//! One client connection, from its first bytes to its close.
//!
//! Its first bytes tell the protocol: HTTP/2's connection preface, or HTTP/1.
//!
//! - **HTTP/2** is served by one hyper connection for the connection's life.
//! - **HTTP/1** is served by one hyper connection *per request*, told to end once its
//!   response is out and taken apart ([`Exchange`]); the next request on the socket gets
//!   a new one. Between requests the connection is only its socket and a
//!   waiting task: hyper's HTTP/1 connection keeps a read and a write buffer for as long
//!   as it lives (about 30 kB per connection once it has served a request), which made
//!   10,000 idle keep-alive clients cost 370 MB. Bytes read past a response (a
//!   pipelined request) are handed to the next exchange, and a connection whose request
//!   body was not read to its end is closed rather than read on.
//!
//! Deadlines are those of one hyper connection with a header timer: from the accept, or
//! from the end of the last response, the next request head is due within
//! `header_read_timeout_ms` (an idle keep-alive connection is closed then too).

use std::io;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use super::exchange::{Exchange, ExchangeService, Routed};
use super::head_errors::{HeadErrors, MAX_HEAD_BYTES};
use super::prefixed::Prefixed;
use super::refusals::{Refusals, refusal};
use crate::metrics::ConnectionRefusal;

/// The first bytes of every HTTP/2 connection with prior knowledge (RFC 9113 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What every client connection is served with.
pub(super) struct Serving {
    pub(super) http1: http1::Builder,
    pub(super) http2: http2::Builder<TokioExecutor>,
    /// `connections.header_read_timeout_ms`.
    pub(super) head_due: std::time::Duration,
    pub(super) refusals: Arc<Refusals>,
    /// Cancelled at shutdown: idle connections close, busy ones after their response.
    pub(super) stopping: CancellationToken,
}

impl Serving {
    pub(super) fn new(
        head_due: std::time::Duration,
        refusals: Arc<Refusals>,
        stopping: CancellationToken,
    ) -> Self {
        let mut http1 = http1::Builder::new();
        http1.timer(TokioTimer::new()).max_buf_size(MAX_HEAD_BYTES);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        // HTTP/2 counts each header's name and value plus 32 bytes (RFC 9113 6.5.2).
        http2
            .timer(TokioTimer::new())
            .max_header_list_size(MAX_HEAD_BYTES as u32);
        Self {
            http1,
            http2,
            head_due,
            refusals,
            stopping,
        }
    }

    /// Serves `tcp` until the client or the server closes it.
    pub(super) async fn serve(&self, mut tcp: TcpStream, routed: Routed) {
        let head_due = Instant::now() + self.head_due;
        // One wait for the whole connection (each new one takes a lock to register).
        let stopping = self.stopping.cancelled();
        tokio::pin!(stopping);
        let first = tokio::select! {
            first = tokio::time::timeout_at(head_due, read_protocol(&mut tcp)) => first,
            () = stopping.as_mut() => return,
        };
        match first {
            Err(_elapsed) => self.refusals.note(ConnectionRefusal::HeaderTimeout),
            Ok(Err(_)) => {}
            Ok(Ok(first)) if first.is_empty() => {}
            Ok(Ok(first)) if first[..] == H2_PREFACE[..] => {
                self.serve_http2(tcp, first, routed, stopping).await
            }
            Ok(Ok(first)) => {
                self.serve_http1(tcp, first, head_due, routed, stopping)
                    .await
            }
        }
    }

    async fn serve_http2(
        &self,
        tcp: TcpStream,
        first: Bytes,
        routed: Routed,
        stopping: Pin<&mut WaitForCancellationFuture<'_>>,
    ) {
        let connection = self
            .http2
            .serve_connection(TokioIo::new(Prefixed::new(first, tcp)), routed);
        tokio::pin!(connection);
        let ended = tokio::select! {
            ended = connection.as_mut() => ended,
            () = stopping => {
                // A GOAWAY: the streams under way finish, no new one starts.
                connection.as_mut().graceful_shutdown();
                connection.await
            }
        };
        self.note_end(ended);
    }

    /// One exchange after another, each on a hyper connection of its own.
    async fn serve_http1(
        &self,
        mut tcp: TcpStream,
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
            let exchange = Arc::new(Exchange::default());
            let service = ExchangeService {
                routed: routed.clone(),
                exchange: Arc::clone(&exchange),
            };
            let mut http1 = self.http1.clone();
            http1.header_read_timeout(head_due.saturating_duration_since(Instant::now()));
            let io = TokioIo::new(HeadErrors::new(Prefixed::new(unread, tcp)));
            let mut connection = http1.serve_connection(io, service);
            let mut ending = false;
            let ended = loop {
                tokio::select! {
                    ended = std::future::poll_fn(|cx| connection.poll_without_shutdown(cx)) => {
                        break ended;
                    }
                    // The answer is out: the connection ends (hyper would otherwise wait
                    // on it for the next request, with its buffers) and gives the socket
                    // back. Its head was written while keep-alive was still on.
                    () = exchange.answered(), if !ending => {
                        ending = true;
                        Pin::new(&mut connection).graceful_shutdown();
                    }
                    // A request under way is answered (with `Connection: close`), then
                    // the connection closes; one not begun closes now.
                    () = stopping.as_mut(), if !ending => {
                        if !exchange.started() {
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
            if !exchange.reusable() || self.stopping.is_cancelled() {
                let _ = tcp.shutdown().await;
                return;
            }
            // What hyper read past the response first, then what it never read: copied
            // out, since hyper's read buffer (8 KiB, even when empty) must not stay with
            // the idle connection.
            unread = if parts.read_buf.is_empty() && rest.is_empty() {
                Bytes::new()
            } else {
                [parts.read_buf, rest].concat().into()
            };
            head_due = Instant::now() + self.head_due;
        }
    }

    /// Waits, holding no buffer, until the socket has something to read (the next
    /// request, or the client's close, which the next exchange then reads): `false` when
    /// the head is overdue (counted as a refusal) or the server is stopping.
    async fn await_next_head(
        &self,
        tcp: &TcpStream,
        head_due: Instant,
        stopping: Pin<&mut WaitForCancellationFuture<'_>>,
    ) -> bool {
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

/// Reads the connection's first bytes, as many as tell HTTP/2's preface from anything
/// else (at most 24): empty when the client closed before sending any.
async fn read_protocol(tcp: &mut TcpStream) -> io::Result<Bytes> {
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
