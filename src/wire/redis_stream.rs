//! The byte stream every Redis connection runs on (the limiter's scripts in `resp`, the
//! `redis` crate's connections and the wake-up subscription): plain TCP, a Unix socket,
//! or TLS over TCP (`rediss://`). fleetgate opens it itself, rather than letting the
//! `redis` crate connect, so that one TLS setup (trusted roots, client certificate, the
//! name the server's certificate must carry) serves every connection alike; the crate
//! has no setting for the server name.
//!
//! [`Stream`] is an enum, not a boxed trait object: the limiter's plain TCP connection,
//! on the request path, splits into its owned halves as before, with no indirection.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// Where a Redis server listens, and how to talk to it.
#[derive(Clone)]
pub(crate) enum Address {
    Tcp {
        host: String,
        port: u16,
        tls: Option<Tls>,
    },
    Unix(PathBuf),
}

/// TLS on a TCP connection: the client's setup, and the name the server's certificate
/// must carry (the URL's host unless overridden, e.g. when connecting by IP).
#[derive(Clone)]
pub(crate) struct Tls {
    pub(crate) connector: TlsConnector,
    pub(crate) server_name: ServerName<'static>,
}

/// A connection to Redis.
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Address {
    /// Connects, and over TLS completes the handshake. The error says which step
    /// failed (never with a secret: TLS errors name certificates, not keys).
    pub(crate) async fn connect(&self) -> Result<Stream, String> {
        let cannot = |e: io::Error| format!("cannot connect: {e}");
        match self {
            Self::Tcp { host, port, tls } => {
                let tcp = TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(cannot)?;
                tcp.set_nodelay(true).map_err(cannot)?;
                let Some(tls) = tls else {
                    return Ok(Stream::Tcp(tcp));
                };
                let secured = tls
                    .connector
                    .connect(tls.server_name.clone(), tcp)
                    .await
                    .map_err(|e| format!("TLS handshake with {host}:{port}: {e}"))?;
                Ok(Stream::Tls(Box::new(secured)))
            }
            Self::Unix(path) => UnixStream::connect(path)
                .await
                .map(Stream::Unix)
                .map_err(cannot),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Self::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Self::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_flush(cx),
            Self::Unix(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Self::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
