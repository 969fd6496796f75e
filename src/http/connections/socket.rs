//! What a client connection is served over: the TCP socket itself (plain HTTP), or a
//! TLS stream on it (HTTPS, `[tls]`).

use std::future::Future;
use std::io;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

/// A client connection's byte stream.
pub(super) trait Socket: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Ready once a read would not wait: bytes have come, or the client closed.
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_;
}

impl Socket for TcpStream {
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_ {
        TcpStream::readable(self)
    }
}

impl Socket for TlsStream<TcpStream> {
    /// Ready at once when rustls holds plaintext not read yet (a read of the socket
    /// decrypts every whole record it brings) or the client's close_notify; otherwise
    /// when the socket brings bytes.
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send + '_ {
        let (tcp, tls) = self.get_ref();
        let waiting = tls.wants_read();
        async move {
            if waiting {
                tcp.readable().await
            } else {
                Ok(())
            }
        }
    }
}
