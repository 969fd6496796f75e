//! At most one of something every so often, with how many were held back in between:
//! the log line of a refusal that may come thousands of times a second, the one logged
//! and recorded request of unauthenticated noise (`request_record`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub struct Throttled {
    every: Duration,
    /// When one was last let through (`None`: never).
    last: Mutex<Option<Instant>>,
    /// Held back since then.
    held: AtomicU64,
}

impl Throttled {
    /// Lets one through at most every `every`.
    pub const fn new(every: Duration) -> Self {
        Self {
            every,
            last: Mutex::new(None),
            held: AtomicU64::new(0),
        }
    }

    /// Notes one occurrence. `Some(n)`: let this one through; `n` were held back since
    /// the last one let through. `None`: hold it back.
    pub fn note(&self) -> Option<u64> {
        self.note_at(Instant::now())
    }

    fn note_at(&self, now: Instant) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|at| now.saturating_duration_since(at) < self.every) {
            self.held.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(now);
        Some(self.held.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_goes_through_then_the_rest_are_counted_until_the_next() {
        let throttled = Throttled::new(Duration::from_secs(1));
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        assert_eq!(throttled.note_at(at(0)), Some(0));
        assert_eq!(throttled.note_at(at(10)), None);
        assert_eq!(throttled.note_at(at(999)), None);
        assert_eq!(throttled.note_at(at(1_000)), Some(2));
        assert_eq!(throttled.note_at(at(1_500)), None);
        assert_eq!(throttled.note_at(at(2_000)), Some(1));
    }
}
