//! The configured models and their vLLM nodes: which short id exists, which one is the
//! default, which node serves the next request, and whether any is up.
//!
//! - Balancing: power of two choices among the nodes that are up and below their
//!   `max_in_flight`, by in-flight count over weight; with `routing = "prefix"`, the
//!   node that owns the prompt's prefix first (`prefix.rs`).
//! - Capacity: when every node that is up is full (at its `max_in_flight`, or at the
//!   limit learned once it reported requests waiting: `hold.rs`), requests wait in a
//!   bounded per-model queue (`fleet.queue_size`, `fleet.queue_timeout_ms`), then get
//!   503; the next free slot goes to the key served least for its share (`turns.rs`).
//! - Nodes: `node.rs`; a model's pick and queue: `model.rs`.
//! - Health: see `ejection.rs` (ejection, back-off) and `background::prober` (active probes).
//! - Scale to zero: `sleep.rs` (a model's state and keep-warm policy) and `wake.rs`
//!   (the hook calls).
//! - Live changes: `change.rs` (a reloaded config's nodes for each model, swapped in
//!   while requests keep the node they took).
//!
//! What each node actually serves (checkpoint name, context length) is learned from its
//! `/v1/models`, at start-up and by every probe.

mod change;
mod decode;
mod ejection;
mod hold;
mod load;
mod model;
mod node;
mod prefix;
mod sleep;
mod turns;
mod wake;

pub use change::{ModelChanges, NodeChange, NodeRef, Planned};
pub use decode::DecodeRate;
pub use ejection::{DownReason, Health};
pub use hold::HELD_READING;
pub use load::Reported;
pub use model::{Model, NoNode, Taken};
pub use node::{InFlight, Node};
pub use prefix::{Affinity, Decision, PromptStart};
pub use sleep::Sleep;
pub use turns::{Charge, Counters, Turn};

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

    /// The nodes `config` asks for, for each model of this fleet that it names
    /// (`change.rs`); nothing changes until each is committed. Models it adds or leaves
    /// out are not touched: that takes a restart.
    pub fn plan<'a>(&'a self, config: &'a Config) -> Vec<Planned<'a>> {
        self.models
            .iter()
            .filter_map(|model| {
                let entry = config.models.iter().find(|m| m.id == model.id)?;
                Some(Planned::new(model, entry))
            })
            .collect()
    }

    /// Every node of every model, now.
    pub fn nodes(&self) -> Vec<std::sync::Arc<Node>> {
        let mut all = Vec::new();
        for model in &self.models {
            all.extend(model.nodes().iter().cloned());
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const PREFIX: &str = "routing = \"prefix\"";

    /// A fleet of one model on four nodes (nothing listens: no request is sent).
    fn fleet(fleet_keys: &str, node_keys: &str) -> Fleet {
        let nodes: String = (1..=4)
            .map(|i| {
                format!(
                    "[[models.upstreams]]\nurl = \"http://10.0.0.{i}:8000\"\ngpu = \"g{i}\"\n{node_keys}\n"
                )
            })
            .collect();
        let toml = format!("[fleet]\n{fleet_keys}\n[[models]]\nid = \"m\"\n{nodes}");
        Fleet::new(&Config::from_toml(&toml).unwrap())
    }

    fn document(i: usize) -> String {
        format!("document {i}: ") + &"a shared prefix of some length ".repeat(40)
    }

    /// The fleet sees `prompt` once (prefix routing sends only prefixes it has seen to
    /// their owner).
    fn introduce(fleet: &Fleet, prompt: &str) {
        fleet.models()[0].affinity(PromptStart::Text(prompt.as_bytes()));
    }

    async fn pick(fleet: &Fleet, prompt: &str) -> (InFlight, Decision) {
        let model = &fleet.models()[0];
        let affinity = model.affinity(PromptStart::Text(prompt.as_bytes()));
        let taken = model.acquire(None, affinity, TURN).await.unwrap();
        (taken.in_flight, taken.decision)
    }

    const TURN: Turn = Turn {
        key: 1,
        share: 1,
        cost: 1.0,
    };

    #[tokio::test]
    async fn independently_built_fleets_send_each_prefix_to_the_same_node() {
        let (a, b) = (fleet(PREFIX, ""), fleet(PREFIX, ""));
        let mut owners = HashSet::new();
        for i in 0..500 {
            let prompt = document(i);
            introduce(&a, &prompt);
            introduce(&b, &prompt);
            let (on_a, decision) = pick(&a, &format!("{prompt} one branch")).await;
            let (on_b, _) = pick(&b, &format!("{prompt} another branch")).await;
            assert_eq!(decision, Decision::Owner);
            assert_eq!(on_a.upstream().url, on_b.upstream().url, "prompt {i}");
            owners.insert(on_a.upstream().url.clone());
        }
        assert_eq!(owners.len(), 4, "the prefixes spread over every node");
    }

    #[tokio::test]
    async fn a_full_or_overloaded_owner_is_passed_over_for_its_runner_up_then_by_load() {
        let full = fleet(PREFIX, "max_in_flight = 1");
        introduce(&full, &document(0));
        let mut held = Vec::new();
        for expected in [Decision::Owner, Decision::RunnerUp, Decision::FallbackLoad] {
            let (taken, decision) = pick(&full, &document(0)).await;
            assert_eq!(decision, expected);
            held.push(taken);
        }
        let urls: HashSet<_> = held.iter().map(|t| t.upstream().url.clone()).collect();
        assert_eq!(urls.len(), 3, "three different nodes");

        let busy = fleet(
            &format!("{PREFIX}\nprefix_imbalance_abs = 3\nprefix_imbalance_rel = 2"),
            "",
        );
        introduce(&busy, &document(0));
        let mut held = Vec::new();
        // Each takes requests up to 3 above the idle nodes (4 / 0 is more than 2 times).
        for expected in [Decision::Owner, Decision::RunnerUp] {
            for _ in 0..4 {
                let (taken, decision) = pick(&busy, &document(0)).await;
                assert_eq!(decision, expected);
                held.push(taken);
            }
        }
        assert_ne!(held[0].upstream().url, held[4].upstream().url);
        assert_eq!(pick(&busy, &document(0)).await.1, Decision::FallbackLoad);
        drop(held);
        assert_eq!(pick(&busy, &document(0)).await.1, Decision::Owner);
    }

    #[tokio::test]
    async fn a_short_prompt_or_a_new_one_on_busy_nodes_has_no_owner_and_load_routing_none() {
        let prefix = fleet(PREFIX, "");
        assert_eq!(pick(&prefix, "short").await.1, Decision::NoOwner);
        assert_eq!(pick(&prefix, "short").await.1, Decision::NoOwner);
        let forgetful = fleet(&format!("{PREFIX}\nprefix_tracked = 1"), "");
        let (owner, decision) = pick(&forgetful, &document(0)).await;
        assert_eq!(decision, Decision::Owner, "new, and every node idle");
        // Forgotten (one slot), so new again each time: a node busier than the lightest
        // is passed over.
        introduce(&forgetful, &document(1));
        let (runner_up, decision) = pick(&forgetful, &document(0)).await;
        assert_eq!(decision, Decision::RunnerUp);
        introduce(&forgetful, &document(1));
        assert_ne!(owner.upstream().url, runner_up.upstream().url);
        // Both busier than the idle nodes: the load pick (which may still land on one
        // of them, when its two random nodes are those).
        let (_other, decision) = pick(&forgetful, &document(0)).await;
        assert_eq!(decision, Decision::NoOwner);
        // Seen now: one above is within the balance.
        assert_eq!(pick(&forgetful, &document(0)).await.1, Decision::Owner);
        let load = fleet("routing = \"load\"", "");
        assert_eq!(pick(&load, &document(0)).await.1, Decision::Load);
    }

    /// The config of one model on `nodes` (URL, further keys), each labelled by its URL.
    fn reloadable(nodes: &[(&str, &str)]) -> Config {
        let upstreams: String = nodes
            .iter()
            .map(|(url, keys)| {
                let gpu = url.trim_end_matches('/');
                format!("[[models.upstreams]]\nurl = \"{url}\"\ngpu = \"{gpu}\"\n{keys}\n")
            })
            .collect();
        Config::from_toml(&format!("[[models]]\nid = \"m\"\n{upstreams}")).unwrap()
    }

    #[tokio::test]
    async fn a_node_that_stays_is_the_same_node_and_a_removed_one_keeps_its_request() {
        let (a, b, c) = (
            "http://10.0.0.1:8000",
            "http://10.0.0.2:8000",
            "http://10.0.0.3:8000",
        );
        let fleet = Fleet::new(&reloadable(&[(a, ""), (b, "")]));
        let model = &fleet.models()[0];
        let before = model.nodes();
        let (on_b, _) = loop {
            let taken = model.acquire(None, Affinity::Load, TURN).await.unwrap();
            if taken.in_flight.upstream().url == b {
                break (taken.in_flight, taken.decision);
            }
        };

        let next = reloadable(&[(c, ""), (&format!("{a}/"), "weight = 4")]);
        let changes: Vec<_> = fleet.plan(&next).into_iter().map(|p| p.commit()).collect();
        let urls = |nodes: &[NodeRef]| nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>();
        assert_eq!(urls(&changes[0].added), [c]);
        assert_eq!(urls(&changes[0].removed), [b]);
        assert_eq!(
            (
                changes[0].changed[0].weight_before,
                changes[0].changed[0].weight
            ),
            (1, 4)
        );

        let after = model.nodes();
        assert!(
            std::sync::Arc::ptr_eq(&after[1], &before[0]),
            "a stays itself"
        );
        assert_eq!(after[1].weight(), 4);
        assert_eq!(after.len(), 2);
        assert_eq!(
            on_b.upstream().in_flight(),
            1,
            "b's request still counted on b"
        );
        drop(on_b);
        assert_eq!(before[1].in_flight(), 0);
    }
}
