//! What a vLLM node last reported about its own load in `GET /metrics` (read by the
//! prober, parsed by the vLLM client): requests waiting in its queue and KV-cache use. It informs the pick
//! next to fleetgate's own in-flight count, which cannot see other replicas' requests.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::upstream::NodeLoad;

/// The last load a node reported; zero until it has (or when its metrics are off).
#[derive(Default)]
pub struct Reported {
    waiting: AtomicU64,
    /// KV-cache usage in thousandths.
    kv_permille: AtomicU32,
}

impl Reported {
    pub fn set(&self, load: NodeLoad) {
        self.waiting.store(load.waiting, Ordering::Relaxed);
        let permille = (load.kv_cache_usage.clamp(0.0, 1.0) * 1000.0).round() as u32;
        self.kv_permille.store(permille, Ordering::Relaxed);
    }

    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    pub fn kv_permille(&self) -> u32 {
        self.kv_permille.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_usage_is_kept_in_thousandths_within_bounds() {
        let reported = Reported::default();
        reported.set(NodeLoad {
            waiting: 7,
            kv_cache_usage: 1.7,
        });
        assert_eq!((reported.waiting(), reported.kv_permille()), (7, 1000));
    }
}
