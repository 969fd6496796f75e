//! `connections.max_open_per_client`: at most that many connections open at once from
//! one peer address, on each listener (`0`, the default: no such cap), so that one
//! client cannot take all of `connections.max_open` by itself.
//!
//! A client is its TCP peer's IP address, nothing it says (no `X-Forwarded-For`):
//! behind a load balancer or a proxy, every client has the proxy's address, and this
//! cap would be the proxy's.

use std::net::IpAddr;
use std::sync::Arc;

use crate::http::held::{Held, Hold};

/// The connections open from each peer address.
pub(super) struct PerClient {
    /// `0`: no cap, and nothing counted.
    cap: usize,
    open: Arc<Held<IpAddr>>,
}

impl PerClient {
    pub(super) fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            open: Held::new(),
        })
    }

    /// One more connection from `ip`, counted until the hold is dropped; `None` when
    /// `ip` has the cap's worth open already.
    pub(super) fn admit(&self, ip: IpAddr) -> Option<ClientHold> {
        if self.cap == 0 {
            return Some(ClientHold(None));
        }
        let hold = self.open.hold(ip, 1, |open| open < self.cap).ok()?;
        Some(ClientHold(Some(hold)))
    }
}

/// One connection counted against its peer address until dropped.
pub(super) struct ClientHold(
    #[expect(dead_code, reason = "held for its drop")] Option<Hold<IpAddr>>,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_gets_the_cap_and_a_closed_connection_frees_its_place() {
        let per_client = PerClient::new(2);
        let (a, b): (IpAddr, IpAddr) = ([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        let first = per_client.admit(a).unwrap();
        let _second = per_client.admit(a).unwrap();
        assert!(per_client.admit(a).is_none());
        let _other = per_client.admit(b).unwrap();
        drop(first);
        assert!(per_client.admit(a).is_some());
    }

    #[test]
    fn with_no_cap_nothing_is_counted() {
        let per_client = PerClient::new(0);
        let holds: Vec<_> = (0..100)
            .map(|_| per_client.admit([10, 0, 0, 1].into()).unwrap())
            .collect();
        assert_eq!(holds.len(), 100);
        assert!(per_client.open.is_empty());
    }
}
