//! What a vLLM node reports about its own load in `GET /metrics` (Prometheus text), read
//! by the prober: requests waiting in its queue and KV-cache use. It informs the pick
//! next to fleetgate's own in-flight count, which cannot see other replicas' requests.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The last load a node reported; zero until it has (or when its metrics are off).
#[derive(Default)]
pub struct Reported {
    waiting: AtomicU64,
    /// KV-cache usage in thousandths.
    kv_permille: AtomicU32,
}

/// One reading of a node's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct NodeLoad {
    /// `vllm:num_requests_waiting`, summed over engines.
    pub waiting: u64,
    /// `vllm:kv_cache_usage_perc` (0.9.2+) or `vllm:gpu_cache_usage_perc` (older), the
    /// fullest engine, 0..1.
    pub kv_cache_usage: f64,
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

impl NodeLoad {
    /// Reads the two gauges from Prometheus text; other lines, comments and
    /// unparseable values are skipped (label order and `_created` series vary by version).
    pub fn parse(text: &str) -> Self {
        let mut load = Self::default();
        for line in text.lines() {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            if !value.is_finite() || value < 0.0 {
                continue;
            }
            let name = series.split('{').next().unwrap_or("").trim();
            match name {
                "vllm:num_requests_waiting" => load.waiting += value as u64,
                "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                    load.kv_cache_usage = load.kv_cache_usage.max(value);
                }
                _ => {}
            }
        }
        load
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_waiting_and_kv_cache_across_engines_and_versions() {
        let text = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m",engine="1"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
http_requests_total{handler="/v1/completions"} 12.0
garbage line
vllm:num_requests_waiting{engine="2"} NaN
"#;
        assert_eq!(
            NodeLoad::parse(text),
            NodeLoad {
                waiting: 5,
                kv_cache_usage: 0.5
            }
        );
        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.75\n";
        assert_eq!(NodeLoad::parse(old).kv_cache_usage, 0.75);
        assert_eq!(NodeLoad::parse(""), NodeLoad::default());
    }

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
