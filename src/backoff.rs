//! Doubling pauses between retries: `first`, twice as long after each further failure
//! in a row, never more than `max`. Node ejection, the request log's writes, giving back
//! a refused admission, the Redis limiter's resubscription and opening the SQLite file
//! all wait this way.

use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Backoff {
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self { first, max }
    }

    /// The pause after `failures` failures in a row: `first · 2^(failures−1)`, at most
    /// `max` (`first` for the first failure, and for none).
    pub fn after(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(30);
        self.first.saturating_mul(1 << doublings).min(self.max)
    }

    /// The pauses of one series of retries.
    pub fn pauses(self) -> Pauses {
        Pauses {
            backoff: self,
            failures: 0,
        }
    }
}

/// Successive pauses of a [`Backoff`]; [`reset`](Self::reset) after a success.
pub struct Pauses {
    backoff: Backoff,
    failures: u32,
}

impl Pauses {
    /// The pause after one more failure.
    pub fn next_pause(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.backoff.after(self.failures)
    }

    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_the_max_and_start_over_after_a_reset() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let secs: Vec<u64> = (1..=7).map(|s| backoff.after(s).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(backoff.after(u32::MAX), Duration::from_secs(30));
        let mut pauses = backoff.pauses();
        assert_eq!(pauses.next_pause(), Duration::from_secs(1));
        assert_eq!(pauses.next_pause(), Duration::from_secs(2));
        pauses.reset();
        assert_eq!(pauses.next_pause(), Duration::from_secs(1));
    }
}
