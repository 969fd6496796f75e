//! The configured models and their vLLM upstreams: which short id exists, which one is
//! the default, and which upstream serves the next request (the less loaded of two). What each upstream actually
//! serves (checkpoint name, context length) is learned from its `/v1/models`.

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;
use std::sync::{Arc, RwLock};

use crate::config::{Config, ModelConfig, UpstreamConfig};
use crate::error::ApiError;

pub struct Fleet {
    models: Vec<Model>,
    default: usize,
}

pub struct Model {
    pub id: String,
    pub is_default: bool,
    pub max_logprobs: u32,
    upstreams: Vec<Arc<Upstream>>,
}

/// One vLLM server.
pub struct Upstream {
    /// Base URL without a trailing slash.
    pub url: String,
    /// Label returned in `X-Acs-Upstream-Gpu`.
    pub gpu: String,
    /// Relative capacity: the upstream's load is its in-flight count over its weight.
    pub weight: u32,
    /// Requests sent to this upstream and not yet settled.
    in_flight: AtomicUsize,
    served: RwLock<Option<Arc<Served>>>,
}

/// Counts a request as in flight on its upstream while it lives.
pub struct InFlight(Arc<Upstream>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What an upstream reported about itself in `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The served checkpoint name: what vLLM expects in `model` and reports back.
    pub name: String,
    pub max_model_len: u64,
}

impl Fleet {
    pub fn new(config: &Config) -> Self {
        Self {
            models: config.models.iter().map(Model::new).collect(),
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
    fn new(config: &ModelConfig) -> Self {
        Self {
            id: config.id.clone(),
            is_default: config.default,
            max_logprobs: config.max_logprobs,
            upstreams: config.upstreams.iter().map(Upstream::new).collect(),
        }
    }

    pub fn upstreams(&self) -> &[Arc<Upstream>] {
        &self.upstreams
    }

    /// The upstream for the next request: the less loaded of two picked at random (power
    /// of two choices), so load follows each node's speed without every replica
    /// herding onto the same least-loaded node.
    pub fn pick(&self) -> Arc<Upstream> {
        let n = self.upstreams.len();
        if n == 1 {
            return Arc::clone(&self.upstreams[0]);
        }
        let mut rng = rand::rng();
        let a = rng.random_range(0..n);
        let b = (a + rng.random_range(1..n)) % n;
        let (a, b) = (&self.upstreams[a], &self.upstreams[b]);
        Arc::clone(if b.lighter_than(a) { b } else { a })
    }

    /// What the first upstream that has answered `/v1/models` serves, if any has.
    pub fn served(&self) -> Option<Arc<Served>> {
        self.upstreams.iter().find_map(|u| u.served())
    }
}

impl Upstream {
    fn new(config: &UpstreamConfig) -> Arc<Self> {
        Arc::new(Self {
            url: config.url.trim_end_matches('/').to_owned(),
            gpu: config.gpu.clone(),
            weight: config.weight,
            in_flight: AtomicUsize::new(0),
            served: RwLock::new(None),
        })
    }

    /// Counts one more request in flight here until the guard is dropped.
    pub fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether this upstream is less loaded than `other`, weights considered
    /// (`in_flight / weight`, compared without division).
    fn lighter_than(&self, other: &Upstream) -> bool {
        let load = |u: &Upstream, w: u32| u.in_flight() as u128 * u128::from(w);
        load(self, other.weight) < load(other, self.weight)
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
