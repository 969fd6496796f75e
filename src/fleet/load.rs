//! What a vLLM node last reported about itself in `GET /metrics` (read by the prober,
//! parsed by the vLLM client): requests running and waiting in its queue and KV-cache
//! use, which inform the pick next to fleetgate's own in-flight count (which cannot see
//! other replicas' requests) and tell when to hold requests at the gateway (`hold.rs`);
//! and its prefix-cache hit rate, for the metrics.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::upstream::NodeLoad;

/// The last load a node reported; zero until it has (or when its metrics are off).
pub struct Reported {
    running: AtomicU64,
    waiting: AtomicU64,
    /// KV-cache usage in thousandths.
    kv_permille: AtomicU32,
    /// The prefix-cache counters of the last reading.
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    /// The hit rate between the last two readings that saw queries (`f64` bits); NaN
    /// until one has.
    hit_rate: AtomicU64,
}

impl Default for Reported {
    fn default() -> Self {
        Self {
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_permille: AtomicU32::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            hit_rate: AtomicU64::new(f64::NAN.to_bits()),
        }
    }
}

impl Reported {
    /// Called by the node's probe, one reading after the other.
    pub fn set(&self, load: NodeLoad) {
        self.running.store(load.running, Ordering::Relaxed);
        self.waiting.store(load.waiting, Ordering::Relaxed);
        let permille = (load.kv_cache_usage.clamp(0.0, 1.0) * 1000.0).round() as u32;
        self.kv_permille.store(permille, Ordering::Relaxed);
        let (queries, hits) = (load.prefix_cache_queries, load.prefix_cache_hits);
        let before = (
            self.prefix_queries.swap(queries, Ordering::Relaxed),
            self.prefix_hits.swap(hits, Ordering::Relaxed),
        );
        // A restarted node counts from zero again: all it reports is new.
        let (queried, hit) = if queries >= before.0 {
            (queries - before.0, hits.saturating_sub(before.1))
        } else {
            (queries, hits)
        };
        if queried > 0 {
            let rate = (hit as f64 / queried as f64).clamp(0.0, 1.0);
            self.hit_rate.store(rate.to_bits(), Ordering::Relaxed);
        }
    }

    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }

    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    pub fn kv_permille(&self) -> u32 {
        self.kv_permille.load(Ordering::Relaxed)
    }

    /// The share of queried prompt tokens the node found in its prefix cache between
    /// the last two readings that saw queries; `None` until there were any.
    pub fn prefix_cache_hit_rate(&self) -> Option<f64> {
        let rate = f64::from_bits(self.hit_rate.load(Ordering::Relaxed));
        (!rate.is_nan()).then_some(rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_usage_is_kept_in_thousandths_within_bounds() {
        let reported = Reported::default();
        reported.set(NodeLoad {
            running: 3,
            waiting: 7,
            kv_cache_usage: 1.7,
            ..NodeLoad::default()
        });
        assert_eq!(
            (
                reported.running(),
                reported.waiting(),
                reported.kv_permille()
            ),
            (3, 7, 1000)
        );
    }

    #[test]
    fn the_hit_rate_is_that_of_the_tokens_queried_since_the_last_reading() {
        let reported = Reported::default();
        let counters = |queries, hits| NodeLoad {
            prefix_cache_queries: queries,
            prefix_cache_hits: hits,
            ..NodeLoad::default()
        };
        reported.set(counters(0, 0));
        assert_eq!(
            reported.prefix_cache_hit_rate(),
            None,
            "nothing queried yet"
        );
        reported.set(counters(100, 20));
        assert_eq!(reported.prefix_cache_hit_rate(), Some(0.2));
        reported.set(counters(200, 110));
        assert_eq!(reported.prefix_cache_hit_rate(), Some(0.9));
        reported.set(counters(200, 110));
        assert_eq!(
            reported.prefix_cache_hit_rate(),
            Some(0.9),
            "kept while idle"
        );
        reported.set(counters(50, 25));
        assert_eq!(reported.prefix_cache_hit_rate(), Some(0.5), "restarted");
    }
}
