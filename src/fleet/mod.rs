//! The configured models and their vLLM nodes: which short id exists, which one is the
//! default, which node serves the next request, and whether any is up.
//!
//! - Balancing: power of two choices among the nodes that are up and below their
//!   `max_in_flight`, by in-flight count over weight.
//! - Capacity: when every node that is up is full, requests wait in a bounded per-model
//!   queue (`fleet.queue_size`, `fleet.queue_timeout_ms`), then get 503.
//! - Nodes: `node.rs`; a model's pick and queue: `model.rs`.
//! - Health: see `ejection.rs` (ejection, back-off) and `prober.rs` (active probes).
//! - Scale to zero: `sleep.rs` (a model's state and keep-warm policy) and `wake.rs`
//!   (the hook calls).
//!
//! What each node actually serves (checkpoint name, context length) is learned from its
//! `/v1/models`, at start-up and by every probe.

mod ejection;
mod load;
mod model;
mod node;
pub mod prober;
mod sleep;
mod wake;

pub use ejection::Health;
pub use load::Reported;
pub use model::{Model, NoNode};
pub use node::{InFlight, Node};
pub use sleep::Sleep;

use crate::config::Config;
use crate::error::{ApiError, excerpt};

pub struct Fleet {
    models: Vec<Model>,
    default: usize,
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
                .ok_or_else(|| ApiError::ModelNotFound(excerpt(id))),
        }
    }

    /// Every node of every model.
    pub fn nodes(&self) -> impl Iterator<Item = &std::sync::Arc<Node>> {
        self.models.iter().flat_map(|m| m.nodes().iter())
    }
}
