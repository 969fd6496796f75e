//! Knowing when to hold (`fleet.hold = "auto"`, the default): a node without
//! `max_in_flight` gets a limit on this replica's requests in flight on it, learned from
//! what the node reports in its `/metrics`, so that once it starts queueing the excess
//! waits in the model's fleet queue (`model.rs`), where the order between keys is fair,
//! instead of in vLLM's own first-come-first-served queue. With `max_in_flight` set,
//! that is the limit and nothing is learned.
//!
//! Each reading of the node's `/metrics` (by the prober, `background::prober`) gives
//! `running` and `waiting` (`vllm:num_requests_running`, `vllm:num_requests_waiting`:
//! every replica's requests) and the KV-cache use, and is taken with `own`, this
//! replica's requests in flight on the node at that moment. Several replicas may share
//! the node; each sees its own `own` only.
//!
//! - **Queueing** (`waiting > 0`): this replica's part of the queue is its share of the
//!   node's requests, `own / max(running + waiting, own)`, times `waiting`, rounded up;
//!   the limit becomes `max(1, own − part)`. It is computed from what is in flight, not
//!   from the limit before, so the readings taken while the queue drains (before
//!   anything has finished) give the same limit instead of lowering it again and again.
//!   Each replica takes off its own part; rounded up, the parts add up to at least the
//!   queue.
//! - **Calm** (nothing waiting, KV cache below [`KV_MARK_PERMILLE`]): at its limit
//!   (`own ≥ limit`), the limit rises to `own + step`, the step doubling with each such
//!   reading in a row (1, 2, 4, … up to [`MAX_STEP`]) and back to 1 after a reading that
//!   is not calm: room that other replicas' requests left is found in a few readings,
//!   and an overshoot costs at most one step of requests in vLLM's queue until the next
//!   reading, which takes it back. Below its limit nothing changes; once calm readings
//!   with at most half the limit in flight have gone on for [`FORGET_AFTER`], the limit
//!   is forgotten (the next queue teaches a new one).
//! - **Full** (nothing waiting, KV cache at or above [`KV_MARK_PERMILLE`]): vLLM is
//!   about to queue or preempt: the limit does not rise (it covers what is in flight,
//!   which vLLM runs). A node that has not queued gets no limit for it.
//!
//! So a limit exists only after the node reported requests waiting, and it is never
//! below 1. It holds requests beyond what was in flight at the last reading, and only
//! until the next: every reading that shows nothing waiting and room in the KV cache
//! lifts it above what is in flight (work-conserving to within one reading). While a
//! node has a limit, its `/metrics` are read every [`HELD_READING`] (when the probe
//! interval is longer), so that is how long the excess stays in vLLM's queue, or a
//! request at the gateway once the node has room. A node that comes up again forgets
//! its limit (it may have restarted with another batch size).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// KV-cache use (thousandths) from which a node counts as full.
pub const KV_MARK_PERMILLE: u32 = 950;

/// Calm at low load for this long, a node's limit is forgotten.
pub const FORGET_AFTER: Duration = Duration::from_secs(30);

/// The largest step of the limit's rise.
pub const MAX_STEP: usize = 1024;

/// How often a node with a limit has its `/metrics` read, when the probes are rarer.
pub const HELD_READING: Duration = Duration::from_millis(250);

/// No limit learned.
const NONE: usize = usize::MAX;

/// One reading of a node's load, with this replica's requests in flight on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// This replica's requests in flight on the node.
    pub own: usize,
    /// Every replica's requests the node decodes.
    pub running: u64,
    /// Every replica's requests waiting in the node's queue.
    pub waiting: u64,
    /// KV-cache use in thousandths.
    pub kv_permille: u32,
}

/// A node's learned limit, and how it moves.
pub struct Hold {
    /// Read by every pick; [`NONE`] while none is learned.
    limit: AtomicUsize,
    learning: Mutex<Learning>,
}

#[derive(Debug, Clone, Copy)]
struct Learning {
    /// The next rise.
    step: usize,
    /// Since when the readings have been calm with at most half the limit in flight.
    idle_since: Option<Instant>,
}

impl Default for Learning {
    fn default() -> Self {
        Self {
            step: 1,
            idle_since: None,
        }
    }
}

impl Default for Hold {
    fn default() -> Self {
        Self {
            limit: AtomicUsize::new(NONE),
            learning: Mutex::new(Learning::default()),
        }
    }
}

impl Hold {
    /// The limit learned, if any.
    pub fn limit(&self) -> Option<usize> {
        match self.limit.load(Ordering::Relaxed) {
            NONE => None,
            limit => Some(limit),
        }
    }

    fn learning(&self) -> std::sync::MutexGuard<'_, Learning> {
        self.learning
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Learns from one reading; returns whether the limit rose (or went), so that
    /// requests waiting for room should look again.
    pub fn observe(&self, reading: Reading, now: Instant) -> bool {
        let mut learning = self.learning();
        let before = self.limit.load(Ordering::Relaxed);
        let after = learning.next(before, reading, now);
        self.limit.store(after, Ordering::Relaxed);
        after > before
    }

    /// Drops the limit; returns whether there was one.
    pub fn forget(&self) -> bool {
        let mut learning = self.learning();
        *learning = Learning::default();
        self.limit.swap(NONE, Ordering::Relaxed) != NONE
    }
}

impl Learning {
    /// The limit after `reading`, from `limit` ([`NONE`]: none yet).
    fn next(&mut self, limit: usize, reading: Reading, now: Instant) -> usize {
        let own = reading.own;
        if reading.waiting > 0 {
            *self = Self::default();
            // At least `waiting`, so the part is at most `own`.
            let everyone = (reading.running.saturating_add(reading.waiting)).max(own as u64);
            let part = (u128::from(reading.waiting) * own as u128).div_ceil(u128::from(everyone));
            return own.saturating_sub(part as usize).max(1);
        }
        if limit == NONE {
            return NONE;
        }
        if reading.kv_permille >= KV_MARK_PERMILLE {
            *self = Self::default();
            return limit.max(own);
        }
        if own >= limit {
            self.idle_since = None;
            let raised = own.saturating_add(self.step);
            self.step = (self.step * 2).min(MAX_STEP);
            return raised;
        }
        if own.saturating_mul(2) > limit {
            self.idle_since = None;
            return limit;
        }
        let since = *self.idle_since.get_or_insert(now);
        if now.duration_since(since) >= FORGET_AFTER {
            *self = Self::default();
            return NONE;
        }
        limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(own: usize, running: u64, waiting: u64) -> Reading {
        Reading {
            own,
            running,
            waiting,
            kv_permille: 0,
        }
    }

    #[test]
    fn a_node_that_never_queues_is_never_held() {
        let hold = Hold::default();
        let now = Instant::now();
        assert!(!hold.observe(reading(50, 50, 0), now));
        let full = Reading {
            kv_permille: 1000,
            ..reading(60, 60, 0)
        };
        assert!(!hold.observe(full, now));
        assert_eq!(hold.limit(), None);
    }

    #[test]
    fn alone_on_a_queueing_node_the_limit_is_what_it_runs() {
        let hold = Hold::default();
        let now = Instant::now();
        // 12 sent, 4 running, 8 waiting.
        hold.observe(reading(12, 4, 8), now);
        assert_eq!(hold.limit(), Some(4));
        // The next readings, before anything finished: the same, not lower.
        hold.observe(reading(12, 4, 8), now);
        assert_eq!(hold.limit(), Some(4));
        // One finished and one of the queue took its place.
        hold.observe(reading(11, 4, 7), now);
        assert_eq!(hold.limit(), Some(4));
    }

    #[test]
    fn replicas_sharing_a_node_each_take_off_their_part_of_the_queue() {
        let (a, b) = (Hold::default(), Hold::default());
        let now = Instant::now();
        // 9 from A and 3 from B on a node that runs 4: A's part of the 8 waiting is 6,
        // B's 2.
        a.observe(reading(9, 4, 8), now);
        b.observe(reading(3, 4, 8), now);
        assert_eq!((a.limit(), b.limit()), (Some(3), Some(1)));
        // Rounded up: 1 waiting, each takes one off.
        let (c, d) = (Hold::default(), Hold::default());
        c.observe(reading(3, 4, 1), now);
        d.observe(reading(2, 4, 1), now);
        assert_eq!((c.limit(), d.limit()), (Some(2), Some(1)));
    }

    #[test]
    fn the_limit_is_never_below_one() {
        let hold = Hold::default();
        let now = Instant::now();
        hold.observe(reading(0, 100, 50), now);
        assert_eq!(hold.limit(), Some(1));
        hold.observe(reading(1, 100, 50), now);
        assert_eq!(hold.limit(), Some(1));
    }

    #[test]
    fn calm_at_the_limit_it_rises_ever_faster_and_a_queue_takes_it_back() {
        let hold = Hold::default();
        let now = Instant::now();
        hold.observe(reading(6, 4, 2), now);
        assert_eq!(hold.limit(), Some(4));
        // Calm at the limit: 5, 7, 11.
        for expected in [5, 7, 11] {
            let own = hold.limit().unwrap();
            assert!(hold.observe(reading(own, own as u64, 0), now), "rose");
            assert_eq!(hold.limit(), Some(expected));
        }
        // 11 sent, 2 wait: back to 9, and the next rise is 1 again.
        assert!(!hold.observe(reading(11, 9, 2), now));
        assert_eq!(hold.limit(), Some(9));
        hold.observe(reading(9, 9, 0), now);
        assert_eq!(hold.limit(), Some(10));
        // Above the limit (it was lowered under what was in flight) yet calm: above
        // what is in flight.
        hold.observe(reading(14, 12, 2), now);
        assert_eq!(hold.limit(), Some(12));
        hold.observe(reading(13, 13, 0), now);
        assert_eq!(hold.limit(), Some(14));
    }

    #[test]
    fn a_full_kv_cache_stops_the_rise() {
        let hold = Hold::default();
        let now = Instant::now();
        hold.observe(reading(5, 4, 1), now);
        let full = |own| Reading {
            kv_permille: KV_MARK_PERMILLE,
            ..reading(own, 4, 0)
        };
        assert!(!hold.observe(full(4), now));
        assert_eq!(hold.limit(), Some(4));
        hold.observe(full(6), now);
        assert_eq!(hold.limit(), Some(6), "covers what vLLM runs");
    }

    #[test]
    fn the_limit_is_forgotten_after_a_calm_spell_at_low_load() {
        let hold = Hold::default();
        let start = Instant::now();
        hold.observe(reading(10, 8, 2), start);
        assert_eq!(hold.limit(), Some(8));
        // More than half the limit in flight: kept however long.
        hold.observe(reading(5, 5, 0), start);
        hold.observe(reading(5, 5, 0), start + FORGET_AFTER * 2);
        assert_eq!(hold.limit(), Some(8));
        // At most half: forgotten once that has lasted FORGET_AFTER.
        let later = start + FORGET_AFTER * 3;
        hold.observe(reading(4, 4, 0), later);
        hold.observe(reading(1, 1, 0), later + FORGET_AFTER / 2);
        assert_eq!(hold.limit(), Some(8));
        assert!(hold.observe(reading(0, 0, 0), later + FORGET_AFTER));
        assert_eq!(hold.limit(), None);
        // And a queue teaches a new one.
        hold.observe(reading(3, 2, 1), later + FORGET_AFTER);
        assert_eq!(hold.limit(), Some(2));
        assert!(hold.forget());
        assert!(!hold.forget());
    }
}
