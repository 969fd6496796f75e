//! The configured models and their vLLM nodes: which short id exists, which one is the
//! default, which node serves the next request, and whether any is up.
//!
//! - Balancing: power of two choices among the nodes that are up and below their
//!   `max_in_flight`, by in-flight count over weight.
//! - Capacity: when every node that is up is full, requests wait in a bounded per-model
//!   queue (`fleet.queue_size`, `fleet.queue_timeout_ms`), then get 503.
//! - Health: see `health.rs` (ejection, back-off) and `prober.rs` (active probes).
//! - Scale to zero: see `wake.rs`.
//!
//! What each node actually serves (checkpoint name, context length) is learned from its
//! `/v1/models`, at start-up and by every probe.

pub mod health;
pub mod load;
pub mod prober;
pub mod wake;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, FleetSettings, ModelConfig, UpstreamConfig};
use crate::error::ApiError;
use health::{Backoff, Health};
use wake::Sleep;

pub struct Fleet {
    models: Vec<Model>,
    default: usize,
}

pub struct Model {
    pub id: String,
    pub is_default: bool,
    pub max_logprobs: u32,
    /// Worst-case decode speed of one sequence, for the non-streaming window.
    pub decode_tokens_per_second: f64,
    upstreams: Vec<Arc<Upstream>>,
    /// Signalled when a request leaves a node or a node comes up.
    freed: Arc<Notify>,
    /// Requests waiting in this model's fleet queue.
    queued: AtomicU32,
    queue_size: u32,
    queue_timeout: Duration,
    /// Scale to zero (wake hook, keep-warm), when configured.
    pub sleep: Sleep,
}

/// One vLLM server.
pub struct Upstream {
    /// Base URL without a trailing slash.
    pub url: String,
    /// Label returned in `X-Acs-Upstream-Gpu`.
    pub gpu: String,
    /// Relative capacity: the upstream's load is its in-flight count over its weight.
    pub weight: u32,
    max_in_flight: Option<usize>,
    /// Requests sent to this upstream and not yet settled.
    in_flight: AtomicUsize,
    pub health: Health,
    /// What the node last reported about its own queue and KV cache.
    pub reported: load::Reported,
    /// The model's `freed`.
    freed: Arc<Notify>,
    served: RwLock<Option<Arc<Served>>>,
}

/// Counts a request as in flight on its upstream while it lives.
pub struct InFlight(Arc<Upstream>);

impl InFlight {
    pub fn upstream(&self) -> &Arc<Upstream> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        // Every waiter looks again: one woken alone might be a failover that must avoid
        // this very node, while another could have used the slot.
        self.0.freed.notify_waiters();
    }
}

/// What an upstream reported about itself in `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The served checkpoint name: what vLLM expects in `model` and reports back.
    pub name: String,
    pub max_model_len: u64,
}

/// Why no node could be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoNode {
    /// No node of the model is up (or the model is asleep).
    NoneUp,
    /// Every node that is up stayed at its `max_in_flight` for the whole queue time,
    /// or the queue was full.
    Busy,
}

impl NoNode {
    pub fn into_error(self, model: &str) -> ApiError {
        ApiError::UpstreamUnavailable(match self {
            Self::NoneUp => format!("No node of model '{model}' is up right now. Retry shortly."),
            Self::Busy => format!(
                "Every node of model '{model}' is at capacity and the wait queue is full or timed out. Retry shortly."
            ),
        })
    }
}

impl Fleet {
    pub fn new(config: &Config) -> Self {
        Self {
            models: config
                .models
                .iter()
                .map(|m| Model::new(m, &config.fleet))
                .collect(),
            default: config.default_model_index(),
        }
    }

    pub fn models(&self) -> &[Model] {
        &self.models
    }

    /// The model a request names, or the default model when it names none.
    pub fn resolve(&self, id: Option<&str>) -> Result<&Model, ApiError> {
        match id {
            None => Ok(&self.models[self.default]),
            Some(id) => self
                .models
                .iter()
                .find(|m| m.id == id)
                .ok_or_else(|| ApiError::ModelNotFound(id.to_owned())),
        }
    }

    pub fn upstreams(&self) -> impl Iterator<Item = &Arc<Upstream>> {
        self.models.iter().flat_map(|m| m.upstreams.iter())
    }
}

impl Model {
    fn new(config: &ModelConfig, fleet: &FleetSettings) -> Self {
        let freed = Arc::new(Notify::new());
        let backoff = Backoff {
            base: Duration::from_millis(fleet.eject_base_ms),
            max: Duration::from_millis(fleet.eject_max_ms),
        };
        Self {
            id: config.id.clone(),
            is_default: config.default,
            max_logprobs: config.max_logprobs,
            decode_tokens_per_second: config.decode_tokens_per_second,
            upstreams: config
                .upstreams
                .iter()
                .map(|u| Upstream::new(u, backoff, Arc::clone(&freed)))
                .collect(),
            freed,
            queued: AtomicU32::new(0),
            queue_size: fleet.queue_size,
            queue_timeout: Duration::from_millis(fleet.queue_timeout_ms),
            sleep: Sleep::new(config),
        }
    }

    pub fn upstreams(&self) -> &[Arc<Upstream>] {
        &self.upstreams
    }

    /// Whether `upstream` takes requests: it is up and its model is not asleep.
    pub fn takes_requests(&self, upstream: &Upstream) -> bool {
        !self.sleep.is_asleep() && upstream.health.is_up()
    }

    /// The nodes that take requests.
    pub fn in_rotation(&self) -> impl Iterator<Item = &Arc<Upstream>> {
        self.upstreams.iter().filter(|u| self.takes_requests(u))
    }

    /// Whether any node takes requests.
    pub fn is_up(&self) -> bool {
        self.in_rotation().next().is_some()
    }

    /// Requests waiting in the fleet queue now.
    pub fn queued(&self) -> u32 {
        self.queued.load(Ordering::Relaxed)
    }

    /// Requests in flight on all nodes.
    pub fn in_flight(&self) -> usize {
        self.upstreams.iter().map(|u| u.in_flight()).sum()
    }

    /// A node that is up, for questions about the model (`/v1/models`, `/tokenize`);
    /// not counted in flight.
    pub fn any_up(&self) -> Option<Arc<Upstream>> {
        match self.in_rotation().count() {
            0 => None,
            n => self
                .in_rotation()
                .nth(rand::rng().random_range(0..n))
                .map(Arc::clone),
        }
    }

    /// A node for the next request, counted in flight from here on; waits in the fleet
    /// queue while every node that is up is full. `exclude`: a node that just failed
    /// this request.
    pub async fn acquire(&self, exclude: Option<&Upstream>) -> Result<InFlight, NoNode> {
        let give_up = Instant::now() + self.queue_timeout;
        let mut waiting: Option<Queued<'_>> = None;
        loop {
            // Registered before looking, so a slot freed in between is not missed.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match self.try_pick(exclude) {
                Ok(taken) => return Ok(taken),
                Err(NoNode::NoneUp) => return Err(NoNode::NoneUp),
                Err(NoNode::Busy) => {}
            }
            if waiting.is_none() {
                waiting = Some(Queued::join(self).ok_or(NoNode::Busy)?);
            }
            tokio::time::timeout_at(give_up.into(), freed)
                .await
                .map_err(|_| NoNode::Busy)?;
        }
    }

    /// Power of two choices among the nodes that are up and have room.
    fn try_pick(&self, exclude: Option<&Upstream>) -> Result<InFlight, NoNode> {
        let up = self
            .in_rotation()
            .filter(|u| !exclude.is_some_and(|e| std::ptr::eq(e, &***u)));
        let mut open: Vec<&Arc<Upstream>> = Vec::with_capacity(self.upstreams.len());
        let mut any_up = false;
        for upstream in up {
            any_up = true;
            if upstream.has_room() {
                open.push(upstream);
            }
        }
        if !any_up {
            return Err(NoNode::NoneUp);
        }
        // Another request may take the last slot between the look and the take: retry
        // with what is left.
        while !open.is_empty() {
            let mut rng = rand::rng();
            let n = open.len();
            let a = rng.random_range(0..n);
            let pick = if n == 1 {
                a
            } else {
                let b = (a + rng.random_range(1..n)) % n;
                if open[b].lighter_than(open[a]) { b } else { a }
            };
            if let Some(taken) = open[pick].try_start() {
                return Ok(taken);
            }
            open.swap_remove(pick);
        }
        Err(NoNode::Busy)
    }

    /// Waits until a node is up (a boot finished), at most until `until`.
    pub async fn wait_up(&self, until: Instant) -> bool {
        loop {
            let came_up = self.freed.notified();
            tokio::pin!(came_up);
            came_up.as_mut().enable();
            if self.is_up() {
                return true;
            }
            if tokio::time::timeout_at(until.into(), came_up)
                .await
                .is_err()
            {
                return self.is_up();
            }
        }
    }

    /// What the first upstream that has answered `/v1/models` serves, if any has.
    pub fn served(&self) -> Option<Arc<Served>> {
        self.upstreams.iter().find_map(|u| u.served())
    }
}

/// A place in a model's fleet queue, given back on drop.
struct Queued<'a>(&'a Model);

impl<'a> Queued<'a> {
    fn join(model: &'a Model) -> Option<Self> {
        model
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < model.queue_size).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(model))
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Upstream {
    fn new(config: &UpstreamConfig, backoff: Backoff, freed: Arc<Notify>) -> Arc<Self> {
        Arc::new(Self {
            url: config.url.trim_end_matches('/').to_owned(),
            gpu: config.gpu.clone(),
            weight: config.weight,
            max_in_flight: config.max_in_flight.map(|m| m as usize),
            in_flight: AtomicUsize::new(0),
            health: Health::new(backoff),
            reported: load::Reported::default(),
            freed,
            served: RwLock::new(None),
        })
    }

    /// Counts one more request in flight here, unless the node is at `max_in_flight`.
    fn try_start(self: &Arc<Self>) -> Option<InFlight> {
        let limit = self.max_in_flight.unwrap_or(usize::MAX);
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| InFlight(Arc::clone(self)))
    }

    fn has_room(&self) -> bool {
        self.max_in_flight.is_none_or(|m| self.in_flight() < m)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Cancelled if the node is found dead while a request is on it.
    pub fn lost(&self) -> CancellationToken {
        self.health.lost()
    }

    /// The node came up again: wake the requests of its model waiting for one.
    pub fn announce_up(&self) {
        self.freed.notify_waiters();
    }

    /// Whether this upstream is less loaded than `other`: requests in flight from here
    /// plus those waiting in the node's own queue (which counts other replicas' too),
    /// over the weight (compared without division); on a tie, the emptier KV cache.
    fn lighter_than(&self, other: &Upstream) -> bool {
        let load = |u: &Upstream, w: u32| {
            (u.in_flight() as u128 + u128::from(u.reported.waiting())) * u128::from(w)
        };
        let (mine, theirs) = (load(self, other.weight), load(other, self.weight));
        mine < theirs
            || (mine == theirs && self.reported.kv_permille() < other.reported.kv_permille())
    }

    pub fn served(&self) -> Option<Arc<Served>> {
        self.served.read().ok().and_then(|s| s.clone())
    }

    pub fn set_served(&self, served: Served) -> Arc<Served> {
        let served = Arc::new(served);
        if let Ok(mut slot) = self.served.write() {
            *slot = Some(Arc::clone(&served));
        }
        served
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use load::NodeLoad;

    fn node(weight: u32) -> Arc<Upstream> {
        let config = UpstreamConfig {
            url: "http://127.0.0.1:1".into(),
            gpu: "g".into(),
            weight,
            max_in_flight: None,
        };
        let backoff = Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(1),
        };
        Upstream::new(&config, backoff, Arc::new(Notify::new()))
    }

    #[test]
    fn the_lighter_node_counts_its_own_queue_weight_and_kv_cache() {
        let (a, b) = (node(1), node(1));
        let _busy = a.try_start();
        assert!(b.lighter_than(&a), "fewer in flight");
        b.reported.set(NodeLoad {
            waiting: 2,
            kv_cache_usage: 0.0,
        });
        assert!(
            a.lighter_than(&b),
            "two waiting in vLLM's queue outweigh one in flight"
        );
        let heavy = node(3);
        let _three: Vec<_> = (0..3).map(|_| heavy.try_start()).collect();
        assert!(
            !heavy.lighter_than(&a) && !a.lighter_than(&heavy),
            "3/3 = 1/1"
        );
        let (c, d) = (node(1), node(1));
        c.reported.set(NodeLoad {
            waiting: 0,
            kv_cache_usage: 0.9,
        });
        assert!(d.lighter_than(&c), "a tie goes to the emptier KV cache");
    }
}
