//! The configured models and their vLLM upstreams: which short id exists, which one is
//! the default, and which upstream serves the next request. What each upstream actually
//! serves (checkpoint name, context length) is learned from its `/v1/models`.

use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// Round-robin cursor over `upstreams`.
    next: AtomicUsize,
}

/// One vLLM server.
pub struct Upstream {
    /// Base URL without a trailing slash.
    pub url: String,
    /// Label returned in `X-Acs-Upstream-Gpu`.
    pub gpu: String,
    served: RwLock<Option<Arc<Served>>>,
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
            next: AtomicUsize::new(0),
        }
    }

    pub fn upstreams(&self) -> &[Arc<Upstream>] {
        &self.upstreams
    }

    /// The upstream for the next request (round robin; load-aware picking comes with
    /// health tracking).
    pub fn pick(&self) -> Arc<Upstream> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.upstreams.len();
        Arc::clone(&self.upstreams[i])
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
            served: RwLock::new(None),
        })
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
