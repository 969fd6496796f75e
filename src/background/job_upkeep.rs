//! The background work of jobs besides running them: the retention sweep (with the
//! job counts for the metrics), and the watch that wakes this replica's long-polls when
//! their job ended on another replica.

use std::time::Duration;

use futures_util::StreamExt as _;
use tokio_util::sync::CancellationToken;

use crate::state::AppState;
use crate::store::Retention;
use crate::store::now_unix_ms;

/// How often the jobs that long-polls wait for are looked up: a job that ends on
/// another replica wakes its long-polls here within about this long (one ended on
/// this replica wakes them at once).
pub const WATCH_EVERY: Duration = Duration::from_millis(50);
/// How long the watch waits before listening again for the store's announcements
/// after it could not (or they ended).
const LISTEN_AGAIN_AFTER: Duration = Duration::from_secs(5);
/// How often the job counts by status are read for the metrics.
const COUNT_EVERY: Duration = Duration::from_secs(10);

/// Applies the retention rules every `jobs.sweep_interval_ms`, and reads the job
/// counts, until `stop`.
pub async fn sweep(state: AppState, stop: CancellationToken) {
    let settings = state.config().jobs.clone();
    let as_ms = |ms: u64| i64::try_from(ms).unwrap_or(i64::MAX);
    let mut sweeps = tokio::time::interval(Duration::from_millis(settings.sweep_interval_ms));
    let mut counts = tokio::time::interval(COUNT_EVERY);
    loop {
        tokio::select! {
            _ = sweeps.tick() => {
                let retention = Retention {
                    now_ms: now_unix_ms(),
                    content_ttl_ms: as_ms(settings.content_ttl_ms),
                    metadata_ttl_ms: as_ms(settings.metadata_ttl_ms),
                };
                match state.store().jobs().sweep(retention).await {
                    Ok(swept) if swept != Default::default() => tracing::info!(
                        expired = swept.expired,
                        content_deleted = swept.purged,
                        deleted = swept.deleted,
                        "job retention sweep"
                    ),
                    Ok(_) => {}
                    Err(err) => tracing::warn!(error = %err, "the job retention sweep failed; trying again at the next"),
                }
            }
            _ = counts.tick() => {
                if let Ok(counts) = state.store().jobs().status_counts().await {
                    state.metrics().observe_jobs(&counts);
                }
            }
            () = stop.cancelled() => return,
        }
    }
}

/// Wakes the long-polls of jobs that ended on another replica, until `stop`: at once on
/// the store's announcement of an end (PostgreSQL), and by looking the awaited jobs up
/// every [`WATCH_EVERY`] in any case (SQLite, a missed announcement, a job that expired
/// or was cancelled while queued). The lookup costs nothing while no long-poll waits.
pub async fn watch(state: AppState, stop: CancellationToken) {
    let mut ticks = tokio::time::interval(WATCH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ends = state.store().jobs().job_end_signals().await;
    let mut listen_again = tokio::time::Instant::now() + LISTEN_AGAIN_AFTER;
    loop {
        let announced = async {
            match ends.as_mut() {
                Some(ends) => ends.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = ticks.tick() => {}
            end = announced => {
                match end {
                    Some(id) => state.jobs().ended(&id),
                    // The connection was lost: look the jobs up meanwhile.
                    None => ends = None,
                }
                continue;
            }
            () = stop.cancelled() => return,
        }
        if ends.is_none() && tokio::time::Instant::now() >= listen_again {
            ends = state.store().jobs().job_end_signals().await;
            listen_again = tokio::time::Instant::now() + LISTEN_AGAIN_AFTER;
        }
        let awaited = state.jobs().awaited();
        if awaited.is_empty() {
            continue;
        }
        match state.store().jobs().ended(&awaited).await {
            Ok(ended) => {
                for id in ended {
                    state.jobs().ended(&id);
                }
            }
            Err(err) => tracing::debug!(error = %err, "could not look up the awaited jobs"),
        }
    }
}
