//! Live fleet changes: the nodes a reloaded config asks for, for each model of the
//! running fleet, worked out first (`Fleet::plan`) and put in place after
//! ([`Planned::commit`]).
//!
//! A node is known by its URL and GPU label. One that stays is the same [`Node`], with
//! its in-flight count, health, reported load and what it serves; a changed weight or
//! `max_in_flight` is applied to it in place. Prefix ownership stays too: a node's rank
//! is the hash of its URL, so only the prefixes won by a node that comes, or held by one
//! that goes, move. A request keeps the node it took, even one that is removed: the
//! removed node lives on in its `InFlight` until the request ends.

use std::sync::Arc;

use serde::Serialize;
use utoipa::ToSchema;

use super::model::Model;
use super::node::Node;
use crate::config::{ModelConfig, UpstreamConfig};

/// A node, as a reload names it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NodeRef {
    pub url: String,
    pub gpu: String,
}

impl NodeRef {
    fn of(node: &Node) -> Self {
        Self {
            url: node.url.clone(),
            gpu: node.gpu.clone(),
        }
    }
}

/// A node that stays, with its weight or `max_in_flight` changed in place.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NodeChange {
    pub url: String,
    pub gpu: String,
    pub weight_before: u32,
    pub weight: u32,
    pub max_in_flight_before: Option<u32>,
    pub max_in_flight: Option<u32>,
}

/// What a reload changes in the nodes of one model.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelChanges {
    pub model: String,
    /// New nodes; one that did not answer when asked what it serves starts ejected,
    /// as at start-up.
    pub added: Vec<NodeRef>,
    /// Nodes taken out; requests already on them finish there.
    pub removed: Vec<NodeRef>,
    /// Nodes that stay, reweighted or with another `max_in_flight`; they keep their
    /// state.
    pub changed: Vec<NodeChange>,
}

impl ModelChanges {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

/// One model's next nodes, built but not in use yet.
pub struct Planned<'a> {
    model: &'a Model,
    next: Vec<(Arc<Node>, &'a UpstreamConfig)>,
    added: Vec<Arc<Node>>,
    changes: ModelChanges,
}

impl<'a> Planned<'a> {
    pub(super) fn new(model: &'a Model, config: &'a ModelConfig) -> Self {
        let mut running: Vec<Arc<Node>> = model.nodes().iter().cloned().collect();
        let mut changes = ModelChanges {
            model: model.id.clone(),
            added: Vec::new(),
            removed: Vec::new(),
            changed: Vec::new(),
        };
        let mut added = Vec::new();
        let mut next = Vec::with_capacity(config.upstreams.len());
        for entry in &config.upstreams {
            let url = entry.url.trim_end_matches('/');
            let staying = running
                .iter()
                .position(|n| n.url == url && n.gpu == entry.gpu)
                .map(|i| running.swap_remove(i));
            let node = match staying {
                Some(node) => {
                    let (weight, limit) = (node.weight(), node.max_in_flight());
                    if weight != entry.weight || limit != entry.max_in_flight {
                        changes.changed.push(NodeChange {
                            url: node.url.clone(),
                            gpu: node.gpu.clone(),
                            weight_before: weight,
                            weight: entry.weight,
                            max_in_flight_before: limit,
                            max_in_flight: entry.max_in_flight,
                        });
                    }
                    node
                }
                None => {
                    let node = model.new_node(entry);
                    changes.added.push(NodeRef::of(&node));
                    added.push(Arc::clone(&node));
                    node
                }
            };
            next.push((node, entry));
        }
        changes.removed = running.iter().map(|n| NodeRef::of(n)).collect();
        Self {
            model,
            next,
            added,
            changes,
        }
    }

    /// The nodes it adds, to be asked what they serve before they take requests.
    pub fn added(&self) -> &[Arc<Node>] {
        &self.added
    }

    /// Puts the next nodes in place (the weights and limits of those that stay first);
    /// what changed.
    pub fn commit(self) -> ModelChanges {
        for (node, entry) in &self.next {
            node.reconfigure(entry);
        }
        self.model
            .replace_nodes(self.next.into_iter().map(|(node, _)| node).collect());
        self.changes
    }
}
