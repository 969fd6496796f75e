//! Deletes the request log's rows older than `request_log.retention_days` (0: keeps
//! them all), at start and then every [`SWEEP_EVERY`]. The deletes go in batches of
//! [`BATCH_ROWS`], each a short statement of its own with a pause after it, so that the
//! sweep never holds SQLite's one writer for long: the request log's and the ledger's
//! writers get their turn between two batches.

use std::time::Duration;

use crate::state::AppState;
use crate::store::{Store, StoreError, now_unix_ms};

/// How often the sweep runs.
pub const SWEEP_EVERY: Duration = Duration::from_secs(3600);
/// Rows one delete takes at most.
pub const BATCH_ROWS: u32 = 1_000;
/// The pause after a full batch, for the other writers.
const BATCH_PAUSE: Duration = Duration::from_millis(10);
const DAY_MS: i64 = 24 * 3600 * 1000;

/// Sweeps now and then every [`SWEEP_EVERY`], until aborted (at shutdown); returns at
/// once when rows are kept forever.
pub async fn run(state: AppState) {
    let retention_days = state.config().request_log.retention_days;
    if retention_days == 0 {
        return;
    }
    let mut ticks = tokio::time::interval(SWEEP_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match sweep(state.store(), retention_days, now_unix_ms()).await {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(deleted, retention_days, "old request log rows deleted");
            }
            Err(err) => {
                tracing::warn!(error = %err, "could not delete old request log rows; the next sweep tries again");
            }
        }
    }
}

/// Deletes the rows logged more than `retention_days` before `now_ms`, a batch at a
/// time; returns how many. `retention_days = 0` deletes none.
pub async fn sweep(store: &dyn Store, retention_days: u32, now_ms: i64) -> Result<u64, StoreError> {
    if retention_days == 0 {
        return Ok(0);
    }
    let before_ms = now_ms.saturating_sub(i64::from(retention_days).saturating_mul(DAY_MS));
    let mut deleted = 0;
    loop {
        let batch = store.delete_requests_before(before_ms, BATCH_ROWS).await?;
        deleted += batch;
        if batch < u64::from(BATCH_ROWS) {
            return Ok(deleted);
        }
        tokio::time::sleep(BATCH_PAUSE).await;
    }
}
