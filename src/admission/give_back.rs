//! Giving back admissions a shared backend may have applied unseen.
//!
//! A step that failed on a shared backend may still take effect there: a Redis that
//! answers too late (paused, busy, a slow network) runs the script all the same, and
//! gives a running slot or a queue place to a request that was already refused — held
//! until its lease lapses, while it blocks the key's real requests. So each refused
//! lease is given back: it leaves the queue and finishes with nothing used (both
//! idempotent; no-ops for a lease that holds nothing).
//!
//! One task per gateway does it, in arrival order, pausing (further and further apart)
//! while the backend does not answer, and dropping a lease once it could no longer be
//! alive. What waits is bounded ([`MAX_WAITING`]): an outage refuses every request, and
//! each would otherwise hold a task for minutes. A lease beyond the bound is not given
//! back — it lapses by itself (its slot within the lease TTL; its reservation, which
//! only ever errs on the safe side of the budget, after the lapsed-slot keep).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::redis::LAPSED_KEEP;
use super::{Grant, Limiter, Month};
use crate::backoff::Backoff;

/// Pause before the second attempt; doubled after each failed attempt, up to the max.
const FIRST_PAUSE: Duration = Duration::from_millis(250);
const MAX_PAUSE: Duration = Duration::from_secs(4);
/// Leases waiting to be given back, at most (in the queue to the task, and again in
/// its own list).
pub const MAX_WAITING: usize = 10_000;

/// A handle on the give-back task.
pub struct GiveBack {
    queue: mpsc::Sender<Refused>,
    /// Leases not taken because the bound was reached, since the last log line.
    dropped: Arc<AtomicU64>,
    /// How long a refused lease could still be alive.
    window: Duration,
}

struct Refused {
    key: i64,
    lease: String,
    /// Past this, the lease cannot be alive any more.
    until: Instant,
}

impl GiveBack {
    /// Starts the task for `limiter` (inside a Tokio runtime); `None` for a limiter
    /// whose steps never take effect half-way (in process: no leases).
    pub fn start(limiter: Arc<dyn Limiter>) -> Option<Self> {
        // A slot lives three renewal periods without renewal (the Redis limiter's
        // TTL), and its reservation is kept aside for LAPSED_KEEP more; `finish`
        // clears it until then.
        let window = limiter.lease_renewal()? * 3 + LAPSED_KEEP;
        let (queue, rx) = mpsc::channel(MAX_WAITING);
        let dropped = Arc::new(AtomicU64::new(0));
        tokio::spawn(run(limiter, rx, window, Arc::clone(&dropped)));
        Some(Self {
            queue,
            dropped,
            window,
        })
    }

    /// Queues `lease` of `key` to be given back; returns at once.
    pub fn push(&self, key: i64, lease: &str) {
        let refused = Refused {
            key,
            lease: lease.to_owned(),
            until: Instant::now() + self.window,
        };
        if self.queue.try_send(refused).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn run(
    limiter: Arc<dyn Limiter>,
    mut rx: mpsc::Receiver<Refused>,
    window: Duration,
    dropped: Arc<AtomicU64>,
) {
    let mut waiting = VecDeque::new();
    let mut pauses = Backoff::new(FIRST_PAUSE, MAX_PAUSE).pauses();
    loop {
        if waiting.is_empty() {
            let Some(refused) = rx.recv().await else {
                return;
            };
            waiting.push_back(refused);
        }
        while waiting.len() < MAX_WAITING {
            let Ok(refused) = rx.try_recv() else { break };
            waiting.push_back(refused);
        }
        let now = Instant::now();
        let before = waiting.len();
        // In arrival order, so the ones that can no longer be alive are at the front.
        while waiting.front().is_some_and(|r: &Refused| r.until <= now) {
            waiting.pop_front();
        }
        let lapsed = before - waiting.len();
        let over_bound = dropped.swap(0, Ordering::Relaxed);
        if lapsed > 0 || over_bound > 0 {
            tracing::warn!(
                lapsed,
                over_bound,
                "could not give back refused admissions (the admission backend did not answer); they lapse with their leases"
            );
        }
        let Some(refused) = waiting.front() else {
            continue;
        };
        let nothing = Grant {
            max_tokens: 0,
            reserved: 0,
            month: Month::now(),
        };
        let given_back = async {
            limiter.leave(refused.key, &refused.lease).await?;
            limiter
                .finish(refused.key, &refused.lease, &nothing, 0)
                .await
        };
        if given_back.await.is_ok() {
            waiting.pop_front();
            pauses.reset();
        } else {
            // The backend is away: one failing attempt per pause, not one per lease.
            tokio::time::sleep(pauses.next_pause().min(window)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::admission::fake::Backend;

    /// Polls `done` until it holds (bounded).
    async fn until(what: &str, done: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what}: not within 10 s"));
    }

    #[tokio::test]
    async fn an_outage_costs_one_attempt_per_pause_and_every_lease_is_given_back_after() {
        let backend = Arc::new(Backend::default());
        let give_back = GiveBack::start(backend.clone()).unwrap();
        for i in 0..1000 {
            give_back.push(1, &format!("lease-{i}"));
        }
        until("three attempts", || {
            backend.attempts.lock().unwrap().len() >= 3
        })
        .await;
        // Each attempt was at the oldest lease: the others wait, no task per lease.
        let attempts = backend.attempts.lock().unwrap().clone();
        assert!(attempts.iter().all(|l| l == "lease-0"), "{attempts:?}");

        backend.up.store(true, Ordering::SeqCst);
        until("all given back", || {
            backend.given_back.lock().unwrap().len() == 1000
        })
        .await;
    }

    #[tokio::test]
    async fn what_waits_is_bounded() {
        let backend = Arc::new(Backend::default());
        let give_back = GiveBack::start(backend.clone()).unwrap();
        for i in 0..3 * MAX_WAITING {
            give_back.push(1, &format!("lease-{i}"));
        }
        until("a first attempt", || {
            !backend.attempts.lock().unwrap().is_empty()
        })
        .await;
        backend.up.store(true, Ordering::SeqCst);
        // In arrival order: once the one pushed last is given back, so is all before.
        give_back.push(1, "last");
        until("the last one given back", || {
            backend.given_back.lock().unwrap().contains("last")
        })
        .await;
        let given_back = backend.given_back.lock().unwrap().len();
        assert!(
            (MAX_WAITING..=2 * MAX_WAITING + 1).contains(&given_back),
            "{given_back} given back"
        );
    }
}
