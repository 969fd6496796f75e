//! Active health probes: every `fleet.probe_interval_ms`, each node that is up (and
//! each ejected node whose back-off has passed) is asked `GET /health` and
//! `GET /v1/models`, within `fleet.probe_timeout_ms`. A node passes when both answer
//! and it serves the same checkpoint as the model's other nodes. A node that passes is
//! also asked `GET /metrics` for its queue and KV-cache use (`load.rs`), which inform
//! the pick. [`keep_warm`] runs the
//! keep-warm policy (`wake.rs`) on the same beat, in its own task so that a slow sleep
//! hook never delays a probe.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::time::MissedTickBehavior;

use crate::app::AppState;
use crate::fleet::{Model, Upstream};

/// Every `fleet.probe_interval_ms`, after the first interval (start-up has just asked
/// every node).
fn beat(state: &AppState) -> tokio::time::Interval {
    let every = Duration::from_millis(state.config().fleet.probe_interval_ms);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks
}

/// Probes forever; the caller aborts the task on shutdown.
pub async fn run(state: AppState) {
    let mut ticks = beat(&state);
    loop {
        ticks.tick().await;
        let now = Instant::now();
        let state = &state;
        let probes = state.fleet().models().iter().flat_map(|model| {
            model
                .upstreams()
                .iter()
                // While a boot is under way, every beat: a node coming up is seen at once.
                .filter(move |u| model.sleep.is_booting() || u.health.probe_due(now))
                .map(move |upstream| probe(state, model, upstream))
        });
        join_all(probes).await;
    }
}

/// Puts idle models to sleep, forever; the caller aborts the task on shutdown.
pub async fn keep_warm(state: AppState) {
    let mut ticks = beat(&state);
    loop {
        ticks.tick().await;
        let sleeps = state
            .fleet()
            .models()
            .iter()
            .map(|model| model.sleep_if_idle(state.upstream()));
        join_all(sleeps).await;
    }
}

async fn probe(state: &AppState, model: &Model, upstream: &Upstream) {
    let timeout = Duration::from_millis(state.config().fleet.probe_timeout_ms);
    let client = state.upstream();
    let answer = tokio::time::timeout(timeout, async {
        client.health(upstream).await?;
        client.read_served(upstream).await
    })
    .await;
    let failure = match answer {
        Err(_) => format!("no answer within {} ms", timeout.as_millis()),
        Ok(Err(err)) => err.to_string(),
        // Compared with the nodes in rotation only, and remembered only when it
        // matches: one node on another checkpoint (say, mid-upgrade) must not take the
        // others out with it.
        Ok(Ok(served)) => match model
            .upstreams()
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
                let load = tokio::time::timeout(timeout, client.node_load(upstream)).await;
                upstream
                    .reported
                    .set(load.ok().and_then(Result::ok).unwrap_or_default());
                if model.sleep.is_booting() {
                    // A booting node that answers is up, whatever its back-off said.
                    upstream.health.probe_soon();
                }
                if upstream.health.probe_succeeded(Instant::now()) {
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
        state.metrics().upstream(&model.id, &upstream.gpu).ejected();
    } else {
        tracing::debug!(model = %model.id, gpu = %upstream.gpu, reason = %failure, "ejected node still failing");
    }
}
