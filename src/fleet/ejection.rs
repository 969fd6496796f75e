//! One node's health: up, or ejected until a back-off has passed.
//!
//! - A request that fails on the node (connection refused or reset, a 5xx) ejects it
//!   at once (passive ejection), for `eject_base_ms`, doubling with every failure in a
//!   row up to `eject_max_ms`. Failures while already ejected do not add: the requests
//!   in flight when a node dies all fail together, and that is one failure.
//! - The prober (`background::prober`) asks ejected nodes again only once their back-off has
//!   passed (half-open); a good answer re-admits the node, a bad one ejects it for
//!   longer. The streak is cleared only by a request that succeeds, so a node whose
//!   `/health` says yes while its completions fail is re-admitted ever more rarely.
//! - A node that answers beyond what it was asked (`misbehaved`) is ejected the same
//!   way, even when it is its model's last.
//! - A node that fails a probe while up is declared lost: requests waiting on it are
//!   cut rather than left hanging (`lost()`).

use std::sync::Mutex;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;

pub struct Health {
    state: Mutex<State>,
    backoff: Backoff,
}

/// Why a node is out of rotation, as verbose `/health` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownReason {
    /// A request sent to it failed (connection refused or reset, a 5xx).
    RequestFailed,
    /// It did not answer its health probe (or, at start-up, the discovery of what it
    /// serves).
    ProbeFailed,
    /// Its model was put to sleep.
    Asleep,
    /// It answered beyond what it was asked: generated past `max_tokens`, or reported
    /// usage beyond the request's reservation.
    Misbehaved,
}

impl DownReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RequestFailed => "request_failed",
            Self::ProbeFailed => "probe_failed",
            Self::Asleep => "asleep",
            Self::Misbehaved => "misbehaved",
        }
    }
}

#[derive(Debug)]
struct State {
    up: bool,
    /// Why it went down, the last time it did.
    reason: DownReason,
    /// When an ejected node may be probed again.
    until: Instant,
    /// Failures since the last request that succeeded here.
    streak: u32,
    /// Cancelled when the node is found dead; replaced when it comes back.
    lost: CancellationToken,
    /// Times the node was put down on purpose ([`Health::set_down`]): a probe that
    /// started before the last of them says nothing about the node after it.
    downs: u64,
}

/// When a probe started, as [`Health::probe_succeeded`] needs to know.
#[derive(Debug, Clone, Copy)]
pub struct ProbeTicket {
    downs: u64,
}

impl Health {
    pub fn new(backoff: Backoff) -> Self {
        Self {
            state: Mutex::new(State {
                // Optimistic until the first probe: a node that is down fails its first
                // request fast (connection refused) and is ejected then.
                up: true,
                reason: DownReason::RequestFailed,
                until: Instant::now(),
                streak: 0,
                lost: CancellationToken::new(),
                downs: 0,
            }),
            backoff,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn is_up(&self) -> bool {
        self.state().up
    }

    /// Why the node is out of rotation; `None` while it is up.
    pub fn down_reason(&self) -> Option<DownReason> {
        let state = self.state();
        (!state.up).then_some(state.reason)
    }

    /// Cancelled if the node is found dead while a request is on it.
    pub fn lost(&self) -> CancellationToken {
        self.state().lost.clone()
    }

    /// A request failed on the node: eject it. Returns whether it was up.
    pub fn request_failed(&self) -> bool {
        let mut state = self.state();
        if !state.up {
            return false;
        }
        self.eject(&mut state, DownReason::RequestFailed);
        true
    }

    /// The node answered beyond what it was asked: eject it like a failed request, but
    /// even when it is its model's last node in rotation, as nothing it answers can be
    /// charged for. Returns whether it was up.
    pub fn misbehaved(&self) -> bool {
        let mut state = self.state();
        let was_up = state.up;
        self.eject(&mut state, DownReason::Misbehaved);
        was_up
    }

    /// A request succeeded: the node is fine, whatever its streak said.
    pub fn request_succeeded(&self) {
        let mut state = self.state();
        state.streak = 0;
        state.up = true;
        if state.lost.is_cancelled() {
            // It answered after a failed probe: a new life, or every request sent to
            // it would be cut as lost.
            state.lost = CancellationToken::new();
        }
    }

    /// Whether the prober should ask the node now: always while up, and once its
    /// back-off has passed while ejected.
    pub fn probe_due(&self, now: Instant) -> bool {
        let state = self.state();
        state.up || now >= state.until
    }

    /// Taken as a probe starts, for [`probe_succeeded`](Self::probe_succeeded).
    pub fn probe_ticket(&self) -> ProbeTicket {
        ProbeTicket {
            downs: self.state().downs,
        }
    }

    /// The node answered the probe that took `ticket`. Returns whether this re-admitted
    /// it: not before its back-off has passed, and not when it was put to sleep while
    /// the probe ran (the answer came from the node as it was before it went down).
    pub fn probe_succeeded(&self, now: Instant, ticket: ProbeTicket) -> bool {
        let mut state = self.state();
        if state.up || now < state.until || state.downs != ticket.downs {
            return false;
        }
        state.up = true;
        state.lost = CancellationToken::new();
        true
    }

    /// The node did not answer its probe: eject it, and cut what waits on it if it was up.
    /// Returns whether it was up.
    pub fn probe_failed(&self) -> bool {
        let mut state = self.state();
        let was_up = state.up;
        self.eject(&mut state, DownReason::ProbeFailed);
        state.lost.cancel();
        was_up
    }

    /// Eject without counting a failure (the node was put to sleep); the next probe
    /// after `until` may re-admit it.
    pub fn set_down(&self) {
        let mut state = self.state();
        state.up = false;
        state.reason = DownReason::Asleep;
        state.until = Instant::now();
        state.lost.cancel();
        state.downs += 1;
    }

    /// Probe an ejected node at the next round instead of after its back-off (a boot
    /// was just started).
    pub fn probe_soon(&self) {
        self.state().until = Instant::now();
    }

    fn eject(&self, state: &mut State, reason: DownReason) {
        state.up = false;
        state.reason = reason;
        state.streak = state.streak.saturating_add(1);
        state.until = Instant::now() + self.backoff.after(state.streak);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn health(base_ms: u64, max_ms: u64) -> Health {
        Health::new(Backoff::new(
            Duration::from_millis(base_ms),
            Duration::from_millis(max_ms),
        ))
    }

    #[test]
    fn a_failed_request_ejects_once_and_the_probe_waits_for_the_back_off() {
        let h = health(60_000, 60_000);
        assert!(h.is_up());
        assert!(h.request_failed());
        assert!(
            !h.request_failed(),
            "a second failure while ejected adds nothing"
        );
        assert!(!h.is_up());
        assert!(!h.probe_due(Instant::now()));
        assert!(
            !h.probe_succeeded(Instant::now(), h.probe_ticket()),
            "not re-admitted before the back-off"
        );
        assert!(h.probe_due(Instant::now() + Duration::from_secs(61)));
    }

    #[test]
    fn a_probe_after_the_back_off_re_admits_and_keeps_the_streak() {
        let h = health(1, 1000);
        h.request_failed();
        assert!(h.probe_succeeded(Instant::now() + Duration::from_millis(2), h.probe_ticket()));
        assert!(h.is_up());
        // Failing again right after re-admission doubles the back-off.
        h.request_failed();
        assert_eq!(h.state().streak, 2);
        h.request_succeeded();
        assert_eq!(h.state().streak, 0);
        assert!(h.is_up());
    }

    #[test]
    fn a_probe_that_started_before_the_node_was_put_to_sleep_does_not_wake_it() {
        let h = health(1, 1);
        let before = h.probe_ticket();
        h.set_down();
        let later = Instant::now() + Duration::from_millis(2);
        assert!(
            !h.probe_succeeded(later, before),
            "an answer from before the sleep"
        );
        assert!(!h.is_up());
        assert!(
            h.probe_succeeded(later, h.probe_ticket()),
            "a probe after it"
        );
        assert!(h.is_up());
    }

    #[test]
    fn the_down_reason_is_the_last_way_the_node_went_down() {
        let h = health(1, 1);
        assert_eq!(h.down_reason(), None);
        h.request_failed();
        assert_eq!(h.down_reason(), Some(DownReason::RequestFailed));
        h.probe_failed();
        assert_eq!(h.down_reason(), Some(DownReason::ProbeFailed));
        h.request_succeeded();
        assert_eq!(h.down_reason(), None);
        h.set_down();
        assert_eq!(h.down_reason(), Some(DownReason::Asleep));
    }

    #[test]
    fn a_failed_probe_cuts_the_requests_waiting_on_the_node() {
        let h = health(1000, 1000);
        let lost = h.lost();
        assert!(h.probe_failed());
        assert!(lost.is_cancelled());
        assert!(!h.is_up());
    }
}
