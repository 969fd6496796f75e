//! A socket with bytes already read from it put back in front: what a finished HTTP/1
//! exchange read past its end (a pipelined request), or the bytes that told the protocol.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf as _, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub(super) struct Prefixed<T> {
    prefix: Bytes,
    io: T,
}

impl<T> Prefixed<T> {
    pub(super) fn new(prefix: Bytes, io: T) -> Self {
        Self { prefix, io }
    }

    /// The socket, and the bytes of the prefix not read yet.
    pub(super) fn into_parts(self) -> (Bytes, T) {
        (self.prefix, self.io)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.prefix.is_empty() {
            return Pin::new(&mut self.io).poll_read(cx, buf);
        }
        let n = self.prefix.len().min(buf.remaining());
        buf.put_slice(&self.prefix[..n]);
        self.prefix.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    #[tokio::test]
    async fn the_prefix_is_read_first_then_the_socket() {
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(b" world").await.unwrap();
        drop(client);
        let mut io = Prefixed::new(Bytes::from_static(b"hello"), server);
        let mut small = [0u8; 3];
        io.read_exact(&mut small).await.unwrap();
        assert_eq!(&small, b"hel");
        let (rest, _) = Prefixed::new(Bytes::from_static(b"hello"), ()).into_parts();
        assert_eq!(rest, "hello");
        let mut all = Vec::new();
        io.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"lo world");
    }
}
