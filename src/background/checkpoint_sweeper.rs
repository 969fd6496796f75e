//! Deletes the recovery checkpoints that have expired, every
//! `workbench.checkpoint_sweep_secs`. Expiry itself does not wait for it: the store
//! never shows an expired checkpoint; the sweep frees the rows.

use std::time::Duration;

use crate::state::AppState;
use crate::store::now_unix;

/// Sweeps now and then every `checkpoint_sweep_secs`, until aborted (at shutdown).
pub async fn run(state: AppState) {
    let every = Duration::from_secs(state.config().workbench.checkpoint_sweep_secs);
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match state
            .store()
            .workbench()
            .sweep_checkpoints(now_unix())
            .await
        {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, "expired workbench checkpoints deleted"),
            Err(err) => {
                tracing::warn!(error = %err, "could not delete expired workbench checkpoints; the next sweep tries again");
            }
        }
    }
}
