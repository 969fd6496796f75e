//! Keeping the leases of running requests alive (shared backends only).
//!
//! A shared limiter's running slot lapses unless renewed (see [`Limiter::renew`]): a
//! crashed replica's slots come back by themselves. Every running request on this
//! replica is held here for as long as it runs, and one task per gateway renews them
//! all, rather than a task and a timer per request: on a busy gateway most requests end
//! long before their first renewal, and a task per request cost a spawn, a timer
//! registered with (and waking) the runtime's driver, and a wake-up to end it.
//!
//! The task ticks every quarter of the renewal period and renews each lease that has
//! gone three ticks without one. A lease is therefore renewed within one period of its
//! admission and then every three quarters of a period — never less often than the
//! limiter asks. The renewals of one tick run concurrently (each bounded by the
//! limiter's call timeout), and the next tick waits for them.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::{Instant, MissedTickBehavior};

use super::Limiter;

/// The ticks a lease may go without a renewal (out of the four in a period).
const TICKS_BETWEEN_RENEWALS: u32 = 3;

/// The handle on the renewal task.
pub struct Renewals {
    live: Arc<Mutex<Live>>,
}

/// Holds a lease in the renewals until dropped.
pub struct Renewal {
    live: Arc<Mutex<Live>>,
    slot: usize,
}

/// The running leases, in slots reused once free (a request's [`Renewal`] owns its
/// slot, so a slot is freed only by its owner).
#[derive(Default)]
struct Live {
    slots: Vec<Option<Held>>,
    free: Vec<usize>,
}

struct Held {
    key: i64,
    lease: String,
    /// The tick of its last renewal (or the time it was held, before the first).
    renewed: Instant,
}

impl Renewals {
    /// Starts the renewal task for `limiter` (inside a Tokio runtime); `None` for a
    /// limiter whose leases never lapse. The task ends once this handle and every
    /// [`Renewal`] are gone.
    pub fn start(limiter: Arc<dyn Limiter>) -> Option<Self> {
        let every = limiter.lease_renewal()?;
        let live = Arc::new(Mutex::new(Live::default()));
        tokio::spawn(run(limiter, Arc::downgrade(&live), every));
        Some(Self { live })
    }

    /// Renews `lease` of `key` until the returned [`Renewal`] is dropped.
    pub fn hold(&self, key: i64, lease: &str) -> Renewal {
        let held = Held {
            key,
            lease: lease.to_owned(),
            renewed: Instant::now(),
        };
        let mut live = lock(&self.live);
        let slot = match live.free.pop() {
            Some(slot) => {
                live.slots[slot] = Some(held);
                slot
            }
            None => {
                live.slots.push(Some(held));
                live.slots.len() - 1
            }
        };
        drop(live);
        Renewal {
            live: Arc::clone(&self.live),
            slot,
        }
    }

    /// How many leases are held.
    #[cfg(test)]
    fn held(&self) -> usize {
        let live = lock(&self.live);
        live.slots.len() - live.free.len()
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        let mut live = lock(&self.live);
        live.slots[self.slot] = None;
        live.free.push(self.slot);
    }
}

/// The list stays consistent whatever panicked while holding it (every change is one
/// assignment and one push).
fn lock(live: &Mutex<Live>) -> std::sync::MutexGuard<'_, Live> {
    live.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn run(limiter: Arc<dyn Limiter>, live: Weak<Mutex<Live>>, every: Duration) {
    let period = every / (TICKS_BETWEEN_RENEWALS + 1);
    let mut ticks = tokio::time::interval(period);
    // Ticks are at least a period apart, so "three ticks without a renewal" counts in
    // the ticks' own instants and holds however late one of them runs.
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let tick = ticks.tick().await;
        let Some(live) = live.upgrade() else { return };
        let due = due(&mut lock(&live), tick, period * TICKS_BETWEEN_RENEWALS);
        drop(live);
        join_all(due.iter().map(|(key, lease)| {
            let limiter = &limiter;
            async move {
                if let Err(err) = limiter.renew(*key, lease).await {
                    tracing::warn!(error = %err, request_id = %lease, "could not renew the admission lease");
                }
            }
        }))
        .await;
    }
}

/// The leases not renewed for `gap` at `tick`, marked as renewed at it.
fn due(live: &mut Live, tick: Instant, gap: Duration) -> Vec<(i64, String)> {
    let mut due = Vec::new();
    for held in live.slots.iter_mut().flatten() {
        if tick.saturating_duration_since(held.renewed) >= gap {
            held.renewed = tick;
            due.push((held.key, held.lease.clone()));
        }
    }
    due
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::admission::fake::{Backend, RENEWAL as EVERY};

    /// In the runtime's paused time: a held lease is renewed within one period of being
    /// held and then never more than a period apart; a short one is never renewed, and
    /// one dropped is renewed no more.
    #[tokio::test(start_paused = true)]
    async fn held_leases_are_renewed_at_least_every_period_and_dropped_ones_no_more() {
        let backend = Arc::new(Backend::default());
        backend.up.store(true, Ordering::SeqCst);
        let renewals = Renewals::start(backend.clone()).unwrap();
        let start = Instant::now();
        let long = renewals.hold(1, "long");
        // Held half-way between two ticks.
        tokio::time::sleep(EVERY / 8).await;
        let held_at = Instant::now();
        let late = renewals.hold(2, "late");
        drop(renewals.hold(3, "short"));
        tokio::time::sleep(EVERY * 3).await;
        drop(late);
        let dropped_at = Instant::now();
        tokio::time::sleep(EVERY * 3).await;

        for (lease, from, to) in [
            ("long", start, Instant::now()),
            ("late", held_at, dropped_at),
        ] {
            let renewed = backend.renewals_of(lease);
            assert!(renewed.len() >= 3, "{lease}: {renewed:?}");
            let mut last = from;
            for at in renewed.iter().copied().chain([to]) {
                assert!(
                    at - last <= EVERY,
                    "{lease}: {:?} without a renewal",
                    at - last
                );
                last = at;
            }
        }
        assert!(backend.renewals_of("short").is_empty());
        assert!(
            backend
                .renewals_of("late")
                .iter()
                .all(|at| *at <= dropped_at)
        );
        drop(long);
    }

    #[test]
    fn a_lease_is_due_after_the_gap_and_then_after_each_gap_again() {
        let start = Instant::now();
        let gap = Duration::from_millis(300);
        let mut live = Live::default();
        live.slots.push(Some(Held {
            key: 7,
            lease: "req_a".into(),
            renewed: start,
        }));
        live.slots.push(None);
        assert!(due(&mut live, start + gap / 2, gap).is_empty());
        assert_eq!(due(&mut live, start + gap, gap), [(7, "req_a".to_owned())]);
        assert!(due(&mut live, start + gap + gap / 2, gap).is_empty());
        assert_eq!(due(&mut live, start + gap * 2, gap).len(), 1);
    }

    #[test]
    fn dropped_renewals_free_their_slots_for_the_next() {
        let renewals = Renewals {
            live: Arc::new(Mutex::new(Live::default())),
        };
        let a = renewals.hold(1, "req_a");
        let b = renewals.hold(2, "req_b");
        assert_eq!(renewals.held(), 2);
        drop(a);
        assert_eq!(renewals.held(), 1);
        let c = renewals.hold(3, "req_c");
        assert_eq!(lock(&renewals.live).slots.len(), 2, "a's slot was reused");
        drop((b, c));
        assert_eq!(renewals.held(), 0);
    }
}
