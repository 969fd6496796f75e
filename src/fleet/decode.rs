//! How fast one sequence decodes on a node, learned from the requests it answered: a
//! non-streaming request cut short before the node reported its usage (its client went
//! away, its job was cancelled) is charged for what the node generated meanwhile at
//! this speed. Streams need none of this: their frames are counted as they pass.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The weight of the latest answer in the running average: about the last ten answers
/// count, so the speed follows the node's load as it changes.
const WEIGHT: f64 = 0.2;
/// Answers shorter than this say more about the prefill and the network than about
/// the decoding, and are not learned from.
const SHORTEST: Duration = Duration::from_millis(50);

/// Tokens one sequence decodes per second, counted over the whole of an answer (its
/// wait in the node's queue and its prefill included, as an aborted request's time is).
pub struct DecodeRate {
    /// `f64` bits.
    per_second: AtomicU64,
}

impl DecodeRate {
    /// `guess`: the speed until an answer has been learned from (the model's
    /// `decode_tokens_per_second`, a worst case).
    pub fn new(guess: f64) -> Self {
        Self {
            per_second: AtomicU64::new(guess.to_bits()),
        }
    }

    pub fn per_second(&self) -> f64 {
        f64::from_bits(self.per_second.load(Ordering::Relaxed))
    }

    /// An answer of `tokens` a sequence that took `elapsed` from sending to its end.
    pub fn learn(&self, tokens: f64, elapsed: Duration) {
        if elapsed < SHORTEST || tokens.is_nan() || tokens < 1.0 {
            return;
        }
        let sample = tokens / elapsed.as_secs_f64();
        // A lost race between two answers keeps one of them: an average either way.
        let _ = self
            .per_second
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let now = f64::from_bits(bits);
                Some((now + WEIGHT * (sample - now)).to_bits())
            });
    }

    /// What `fan_out` sequences decoded in `elapsed`, at most `max_tokens` each.
    pub fn generated(&self, elapsed: Duration, fan_out: u64, max_tokens: u64) -> u64 {
        let each = (self.per_second() * elapsed.as_secs_f64()).floor();
        // Saturating float-to-int conversion; the rate is finite and positive.
        (each as u64).min(max_tokens).saturating_mul(fan_out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_follows_what_answers_took_and_bounds_the_estimate() {
        let rate = DecodeRate::new(26.0);
        assert_eq!(rate.generated(Duration::from_secs(2), 1, 1000), 52);
        for _ in 0..40 {
            rate.learn(100.0, Duration::from_millis(500));
        }
        assert!(
            (rate.per_second() - 200.0).abs() < 1.0,
            "{}",
            rate.per_second()
        );
        assert_eq!(rate.generated(Duration::from_secs(1), 2, 1000), 2 * 199);
        assert_eq!(rate.generated(Duration::from_secs(60), 2, 1000), 2000);
        // Too short to say anything, or nothing generated: not learned.
        rate.learn(1000.0, Duration::from_millis(10));
        rate.learn(0.0, Duration::from_secs(1));
        assert!((rate.per_second() - 200.0).abs() < 1.0);
    }
}
