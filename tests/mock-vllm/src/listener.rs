//! A listener that can be closed and reopened on the same port ([`FailureMode::Refuse`]),
//! and connections that can all be killed at once.
//!
//! Closing is synchronous: once [`ListenerControl::close`] returns, the socket is closed,
//! so the next connect attempt is refused, and every open connection is aborted (a real
//! vLLM that goes down does not keep its keep-alive connections either).
//!
//! [`FailureMode::Refuse`]: super::FailureMode::Refuse

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::lock::lock;

struct Slot {
    listener: Option<TcpListener>,
    /// The accept loop, parked while the listener is closed.
    waker: Option<Waker>,
    /// Cancelled to kill every connection accepted under it.
    connections: CancellationToken,
    /// Set by shutdown: never reopen.
    shut_down: bool,
}

pub(crate) struct ListenerControl {
    addr: SocketAddr,
    /// Rebinding from a synchronous `set_failure` needs the runtime's reactor.
    runtime: Handle,
    slot: Mutex<Slot>,
}

impl ListenerControl {
    pub fn new(listener: TcpListener) -> io::Result<Self> {
        Ok(Self {
            addr: listener.local_addr()?,
            runtime: Handle::current(),
            slot: Mutex::new(Slot {
                listener: Some(listener),
                waker: None,
                connections: CancellationToken::new(),
                shut_down: false,
            }),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Close the listening socket and abort every open connection.
    pub fn close(&self) {
        let mut slot = lock(&self.slot);
        slot.listener = None;
        slot.connections.cancel();
        slot.connections = CancellationToken::new();
        // The accept loop was registered with the dropped socket: make it park instead.
        if let Some(waker) = slot.waker.take() {
            waker.wake();
        }
    }

    /// Rebind the same address if closed (no-op when open or shut down).
    pub fn reopen(&self) -> io::Result<()> {
        let mut slot = lock(&self.slot);
        if slot.listener.is_some() || slot.shut_down {
            return Ok(());
        }
        // std's bind sets SO_REUSEADDR, so lingering TIME_WAIT sockets do not block it.
        let std_listener = std::net::TcpListener::bind(self.addr)?;
        std_listener.set_nonblocking(true)?;
        let _runtime = self.runtime.enter();
        slot.listener = Some(TcpListener::from_std(std_listener)?);
        if let Some(waker) = slot.waker.take() {
            waker.wake();
        }
        Ok(())
    }

    /// Close for good.
    pub fn shut_down(&self) {
        lock(&self.slot).shut_down = true;
        self.close();
    }

    pub(crate) fn poll_accept(
        &self,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<(KillableStream, SocketAddr)>> {
        let mut slot = lock(&self.slot);
        if !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            slot.waker = Some(cx.waker().clone());
        }
        let Some(listener) = &slot.listener else {
            return Poll::Pending;
        };
        let (stream, addr) = std::task::ready!(listener.poll_accept(cx))?;
        // Like uvicorn: no Nagle delay on small writes (SSE frames).
        stream.set_nodelay(true)?;
        let killed = Box::pin(slot.connections.clone().cancelled_owned());
        Poll::Ready(Ok((KillableStream { stream, killed }, addr)))
    }
}

/// A TCP stream whose reads and writes fail once its kill token is cancelled, which
/// makes hyper drop the connection (and any request in flight on it).
pub(crate) struct KillableStream {
    stream: TcpStream,
    killed: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl KillableStream {
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        match self.killed.as_mut().poll(cx) {
            Poll::Ready(()) => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "mock-vllm closed the connection",
            )),
            Poll::Pending => Ok(()),
        }
    }
}

impl AsyncRead for KillableStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
