//! Refused client connections: why hyper ended one (a head late, malformed or too
//! large), counted in `/metrics` at once and logged as counts.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::{ConnectionRefusal, Metrics};

/// Why the connection was closed without a whole request, if it was: a request head
/// not read in time (by hyper's timer), or one hyper could not parse (answered by
/// hyper, see `head_errors.rs`).
pub(super) fn refusal(err: &(dyn std::error::Error + 'static)) -> Option<ConnectionRefusal> {
    std::iter::successors(Some(err), |e| e.source()).find_map(|e| {
        let err = e.downcast_ref::<hyper::Error>()?;
        if err.is_timeout() {
            Some(ConnectionRefusal::HeaderTimeout)
        } else if err.is_parse_too_large() {
            Some(ConnectionRefusal::HeadTooLarge)
        } else if err.is_parse() {
            Some(ConnectionRefusal::MalformedHead)
        } else {
            None
        }
    })
}

/// Refused connections: counted in `/metrics` at once, and in the log as the counts
/// since the last line.
pub(super) struct Refusals {
    metrics: Metrics,
    max_open: AtomicU64,
    max_open_per_client: AtomicU64,
    header_timeout: AtomicU64,
    malformed_head: AtomicU64,
    head_too_large: AtomicU64,
    tls_handshake: AtomicU64,
}

impl Refusals {
    pub(super) fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            max_open: AtomicU64::new(0),
            max_open_per_client: AtomicU64::new(0),
            header_timeout: AtomicU64::new(0),
            malformed_head: AtomicU64::new(0),
            head_too_large: AtomicU64::new(0),
            tls_handshake: AtomicU64::new(0),
        }
    }

    pub(super) fn note(&self, refusal: ConnectionRefusal) {
        self.metrics.connection_refused(refusal);
        match refusal {
            ConnectionRefusal::MaxOpen => &self.max_open,
            ConnectionRefusal::MaxOpenPerClient => &self.max_open_per_client,
            ConnectionRefusal::HeaderTimeout => &self.header_timeout,
            ConnectionRefusal::MalformedHead => &self.malformed_head,
            ConnectionRefusal::HeadTooLarge => &self.head_too_large,
            ConnectionRefusal::TlsHandshake => &self.tls_handshake,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// One line with the counts since the last one, if there were any. Never anything
    /// the client sent.
    pub(super) fn log(&self) {
        let max_open = self.max_open.swap(0, Ordering::Relaxed);
        let max_open_per_client = self.max_open_per_client.swap(0, Ordering::Relaxed);
        let header_timeout = self.header_timeout.swap(0, Ordering::Relaxed);
        let malformed_head = self.malformed_head.swap(0, Ordering::Relaxed);
        let head_too_large = self.head_too_large.swap(0, Ordering::Relaxed);
        let tls_handshake = self.tls_handshake.swap(0, Ordering::Relaxed);
        if max_open
            + max_open_per_client
            + header_timeout
            + malformed_head
            + head_too_large
            + tls_handshake
            > 0
        {
            tracing::warn!(
                max_open,
                max_open_per_client,
                header_timeout,
                malformed_head,
                head_too_large,
                tls_handshake,
                "client connections refused (max_open: the connection cap was reached; max_open_per_client: the cap of connections from one address was reached; header_timeout: no TLS handshake or no complete request head in time; malformed_head: a request head that could not be parsed, answered 400; head_too_large: a request head over the limits, answered 431; tls_handshake: a failed TLS handshake)"
            );
        }
    }
}
