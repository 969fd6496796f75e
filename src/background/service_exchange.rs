//! The fleet queue's service counts, shared between replicas: every [`EXCHANGE_EVERY`],
//! each model's service since the last exchange goes to the shared limiter (Redis), and
//! what the other replicas counted meanwhile comes back into the keys' counters
//! (`fleet/turns.rs`). So each replica's queue is fair on its own and ranks a key by
//! the service it had on every replica: spreading requests over replicas gains a key
//! at most what it was served elsewhere in the last exchange interval. With in-process
//! counters (one replica) there is nothing to share and this ends at once.

use std::time::Duration;

use crate::state::AppState;

/// How often a replica exchanges its service counts.
pub const EXCHANGE_EVERY: Duration = Duration::from_millis(250);

/// Exchanges every [`EXCHANGE_EVERY`] until aborted (at shutdown).
pub async fn run(state: AppState) {
    let mut ticks = tokio::time::interval(EXCHANGE_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        ticks.tick().await;
        for model in state.fleet().models() {
            let counters = model.service();
            let mine = counters.unshared();
            match state.limiter().exchange_service(&model.id, &mine).await {
                Ok(Some(totals)) => {
                    counters.absorb(&mine, &totals);
                    failing = false;
                }
                Ok(None) => return,
                Err(err) => {
                    // Kept for the next exchange; meanwhile each queue is fair on what
                    // its own replica served.
                    counters.unshared_again(&mine);
                    if !std::mem::replace(&mut failing, true) {
                        tracing::warn!(error = %err, model = %model.id, "could not share the fleet queue's service counts; retrying");
                    }
                }
            }
        }
    }
}
