//! Client connections, of the API listener and of the ops listener alike: accepted up to
//! a cap (`connections.max_open`, `connections.ops_max_open`), served as HTTP/1.1 or
//! HTTP/2 (prior knowledge), each request head due within
//! `connections.header_read_timeout_ms` and at most [`MAX_HEAD_BYTES`] long, and closed
//! gracefully on shutdown.
//!
//! A client cannot hold a socket, a task and memory for as long as it likes: a
//! connection beyond the cap, or beyond `connections.max_open_per_client` from its peer
//! address (`per_client.rs`), is closed as soon as it is accepted; one that sends its
//! request head too slowly, or nothing at all, is closed when the head is due (the same
//! timer closes an HTTP/1 keep-alive connection, or an HTTP/2 one without a request
//! under way, that stays idle that long; an HTTP/2 peer that stops answering pings is
//! dropped too); a head over 16 KiB or 100 header lines gets 431 (from hyper, or in
//! HTTP/2 from h2); a body that trickles in gets 408 from the body reader
//! (`http/body.rs`).
//!
//! An HTTP/1 request head hyper cannot parse (400) or that is over the limits (431) is
//! answered by hyper itself, before there is a request for the router to give an id
//! and an envelope to; [`HeadErrors`] puts the envelope, with an id of its own, in place
//! of hyper's bare answer (`head_errors.rs`). HTTP/2's equivalents are h2's own: a bare
//! 431 and a stream reset for a header list over the limit, a reset or GOAWAY with no
//! response for a malformed one.
//!
//! Each accepted connection is served, from its first byte to its close, on one of the
//! connection threads (`connections.threads`, one per CPU by default): the one with the
//! fewest connections open when it is accepted (`lanes.rs`).
//!
//! With `[tls]` the API listener speaks HTTPS (`socket.rs`): the TLS handshake runs on
//! the connection's thread, never in the accept loop, holding its slot under the cap, and
//! is due when the first request head is; ALPN offers HTTP/2 and HTTP/1.1, and the
//! protocol is then told by the first bytes as without TLS. A handshake that fails is a
//! refusal too. The certificate is the one served when the handshake runs
//! (`https_certificate.rs`).
//!
//! An HTTP/1 connection quiet for a moment after its last answer is handed back by hyper,
//! so that an idle keep-alive connection holds no more than its socket and a waiting
//! task (`client.rs`).
//!
//! Each refusal is counted in `fleetgate_connection_refusals_total` and logged: one line
//! a second with the counts while there are any, so that a flood of them cannot flood
//! the log too. Nothing a client sent is logged.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ConnectionSettings;
use crate::metrics::{ConnectionRefusal, Metrics};

mod client;
mod exchange;
mod head_errors;
mod lanes;
mod per_client;
mod prefixed;
mod refusals;
mod socket;
mod streams;

pub use lanes::Lanes;

use client::Serving;
#[cfg(doc)]
use head_errors::HeadErrors;
use per_client::PerClient;
use refusals::Refusals;

/// After a failed `accept` (e.g. out of file descriptors), wait this long before the
/// next, instead of spinning.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// Refusals are logged as counts at most this often.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(1);

/// A listening socket, and how its connections are taken.
pub struct Listener {
    pub socket: TcpListener,
    /// The most connections open at once.
    pub max_open: usize,
    /// HTTPS with these settings; `None`: plain HTTP.
    pub tls: Option<Arc<ServerConfig>>,
}

/// Serves `router` on `listener` until `stop` resolves, at most `listener.max_open`
/// connections at once, each on one of `lanes`; then accepts no more connections, lets
/// every open one finish the requests it has (HTTP/1 connections close after their
/// current response, HTTP/2 ones get a GOAWAY), and returns once all are closed.
pub async fn serve(
    listener: Listener,
    router: Router,
    settings: &ConnectionSettings,
    lanes: &Lanes,
    metrics: Metrics,
    stop: impl Future<Output = ()>,
) {
    let Listener {
        socket: listener,
        max_open,
        tls,
    } = listener;
    let tls = tls.map(TlsAcceptor::from);
    let head_due = Duration::from_millis(settings.header_read_timeout_ms);
    let slots = Arc::new(Semaphore::new(max_open));
    let per_client = PerClient::new(settings.max_open_per_client);
    let refusals = Arc::new(Refusals::new(metrics.clone()));
    let stopping = CancellationToken::new();
    let serving = Arc::new(Serving::new(
        head_due,
        Arc::clone(&refusals),
        metrics.clone(),
        stopping.clone(),
    ));
    // Not the application's tracked tasks: shutdown waits for these below.
    let connections = TaskTracker::new();
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
        let Some(client) = per_client.admit(remote.ip()) else {
            drop(tcp);
            refusals.note(ConnectionRefusal::MaxOpenPerClient);
            continue;
        };
        // Without TCP_NODELAY a streamed response's small writes (headers, then each
        // chunk) wait on the client's delayed ACK: ~40 ms added to every request.
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::warn!(error = %err, "could not set TCP_NODELAY");
        }
        let routed = exchange::routed(router.clone(), remote);
        let (serving, metrics, tls) = (Arc::clone(&serving), metrics.clone(), tls.clone());
        lanes.serve(&connections, tcp, |tcp| async move {
            let _open = metrics.connection_open();
            match tls {
                None => serving.serve(tcp, routed).await,
                Some(tls) => serving.serve_tls(tcp, &tls, routed).await,
            }
            drop((slot, client));
        });
    }
    drop(listener);
    stopping.cancel();
    connections.close();
    connections.wait().await;
    refusals.log();
}
