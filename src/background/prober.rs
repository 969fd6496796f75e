//! Active health probes: every `fleet.probe_interval_ms`, each node that is up (and
//! each ejected node whose back-off has passed) is asked `GET /health` and
//! `GET /v1/models`, within `fleet.probe_timeout_ms`. A node passes when both answer
//! and it serves the same checkpoint as the model's other nodes. A node that passes is
//! also asked `GET /metrics` for its queue and KV-cache use (`load.rs`), which inform
//! the pick and, with `fleet.hold = "auto"`, teach a node without `max_in_flight` when
//! to hold requests (`fleet/hold.rs`). [`Prober::watch_held`] reads the `/metrics` of
//! the nodes holding requests more often than that, every [`HELD_READING`] (when the
//! probe interval is longer). [`Prober::keep_warm`] runs the
//! keep-warm policy (`sleep.rs`, `wake.rs`) on the same beat, in its own task so that a slow sleep
//! hook never delays a probe.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::time::MissedTickBehavior;

use crate::config::Hold;
use crate::fleet::{HELD_READING, Model, Node};
use crate::state::AppState;

/// The state whose fleet is probed (its client asks the nodes, its metrics count the
/// ejections), and the beat. Cheap to clone; each loop owns one.
#[derive(Clone)]
pub struct Prober {
    state: AppState,
    interval: Duration,
    timeout: Duration,
    /// `fleet.hold = "auto"`: nodes learn when to hold from their readings.
    hold: bool,
}

impl Prober {
    /// The health probes and the keep-warm loop over `state`'s fleet.
    pub fn of(state: &AppState) -> Self {
        let settings = &state.config().fleet;
        Self {
            state: state.clone(),
            interval: Duration::from_millis(settings.probe_interval_ms),
            timeout: Duration::from_millis(settings.probe_timeout_ms),
            hold: settings.hold == Hold::Auto,
        }
    }

    /// Learns what every node serves, so the first requests need not wait for it. A
    /// node that does not answer (within `fleet.probe_timeout_ms`) starts ejected; the
    /// probes re-admit it once it does.
    pub async fn discover(&self) {
        self.introduce(&self.state.fleet().nodes()).await;
    }

    /// [`Self::discover`] for `nodes` only: those a reload adds.
    pub async fn introduce(&self, nodes: &[Arc<Node>]) {
        let all =
            nodes.iter().map(|node| async move {
                let failure =
                    match tokio::time::timeout(self.timeout, node.discover(self.state.upstream()))
                        .await
                    {
                        Ok(Ok(_)) => return,
                        Ok(Err(err)) => err.to_string(),
                        Err(_) => format!("no answer within {} ms", self.timeout.as_millis()),
                    };
                node.health.probe_failed();
                tracing::warn!(upstream = %node.url, error = %failure, "upstream not ready yet");
            });
        join_all(all).await;
    }

    /// Every `fleet.probe_interval_ms`, after the first interval (start-up has just
    /// asked every node).
    fn beat(&self) -> tokio::time::Interval {
        let every = self.interval;
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        ticks
    }

    /// Probes forever; the caller aborts the task on shutdown.
    pub async fn run(self) {
        let mut ticks = self.beat();
        loop {
            ticks.tick().await;
            let now = Instant::now();
            // The nodes of this beat: a reload's changes are probed from the next one.
            let due: Vec<(&Model, Arc<Node>)> = self
                .state
                .fleet()
                .models()
                .iter()
                .flat_map(|model| {
                    model
                        .nodes()
                        .iter()
                        // While a boot is under way, every beat: a node coming up is seen at once.
                        .filter(|n| model.sleep.is_booting() || n.health.probe_due(now))
                        .map(|node| (model, Arc::clone(node)))
                        .collect::<Vec<_>>()
                })
                .collect();
            join_all(due.iter().map(|(model, node)| self.probe(model, node))).await;
        }
    }

    /// Reads the `/metrics` of every node that holds requests (one with a learned
    /// limit, up) every [`HELD_READING`], forever, so that its limit follows its load
    /// closer than the probes do; returns at once when they are that frequent already,
    /// or with `fleet.hold = "off"`. The caller aborts the task on shutdown. A reading
    /// that fails or is late is skipped: the probes judge the node.
    pub async fn watch_held(self) {
        if !self.hold || self.interval <= HELD_READING {
            return;
        }
        let mut ticks = tokio::time::interval(HELD_READING);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let held: Vec<Arc<Node>> = self
                .state
                .fleet()
                .nodes()
                .into_iter()
                .filter(|node| node.hold_limit().is_some() && node.health.is_up())
                .collect();
            let client = self.state.upstream();
            join_all(held.iter().map(|node| async move {
                let reading = tokio::time::timeout(self.timeout, client.node_load(&node.url));
                if let Ok(Ok(load)) = reading.await {
                    node.observe(load, self.hold);
                }
            }))
            .await;
        }
    }

    /// Puts idle models to sleep, forever; the caller aborts the task on shutdown.
    pub async fn keep_warm(self) {
        let mut ticks = self.beat();
        loop {
            ticks.tick().await;
            let sleeps = self
                .state
                .fleet()
                .models()
                .iter()
                .map(|model| model.sleep_if_idle(self.state.upstream()));
            join_all(sleeps).await;
        }
    }

    async fn probe(&self, model: &Model, upstream: &Node) {
        let timeout = self.timeout;
        let client = self.state.upstream();
        let ticket = upstream.health.probe_ticket();
        let answer = tokio::time::timeout(timeout, async {
            client.health(&upstream.url).await?;
            client.read_served(&upstream.url).await
        })
        .await;
        let failure = match answer {
            Err(_) => format!("no answer within {} ms", timeout.as_millis()),
            Ok(Err(err)) => err.to_string(),
            // Compared with the nodes in rotation only, and remembered only when it
            // matches: one node on another checkpoint (say, mid-upgrade) must not take the
            // others out with it.
            Ok(Ok(served)) => match model
                .nodes()
                .iter()
                .filter(|other| !std::ptr::eq(&***other, upstream) && other.health.is_up())
                .find_map(|other| other.served())
            {
                Some(expected) if expected.name != served.name => format!(
                    "serves '{}' while the model's other nodes serve '{}'",
                    served.name, expected.name
                ),
                _ => {
                    upstream.set_served(served);
                    // Optional: a node without metrics just counts as reporting no load.
                    let load = tokio::time::timeout(timeout, client.node_load(&upstream.url)).await;
                    upstream.observe(
                        load.ok().and_then(Result::ok).unwrap_or_default(),
                        self.hold,
                    );
                    if model.sleep.is_booting() {
                        // A booting node that answers is up, whatever its back-off said.
                        upstream.health.probe_soon();
                    }
                    if upstream.health.probe_succeeded(Instant::now(), ticket) {
                        tracing::info!(model = %model.id, gpu = %upstream.gpu, "node is up again");
                        upstream.announce_up();
                        model.boot_done();
                    }
                    return;
                }
            },
        };
        if upstream.health.probe_failed() {
            tracing::warn!(model = %model.id, gpu = %upstream.gpu, reason = %failure, "node failed its probe; ejected");
            self.state
                .metrics()
                .upstream(&model.id, &upstream.gpu)
                .ejected();
        } else {
            tracing::debug!(model = %model.id, gpu = %upstream.gpu, reason = %failure, "ejected node still failing");
        }
    }
}
