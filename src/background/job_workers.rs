//! This replica's job workers: one loop claims jobs while a worker slot is free
//! (`jobs.workers`) and starts a run for each; on shutdown it stops claiming, lets the
//! runs finish within the grace period, then cuts the rest (they are queued again).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backoff::Backoff;
use crate::jobs::run;
use crate::state::AppState;
use crate::store::now_unix_ms;

/// After the grace period, how long cut runs get to queue their jobs again.
const CUT_WAIT: Duration = Duration::from_secs(2);
/// Between claims while the store fails.
const STORE_RETRY: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

/// The claim loop and the runs it started.
pub struct Workers {
    stop: CancellationToken,
    cut: CancellationToken,
    runs: TaskTracker,
    claims: JoinHandle<()>,
}

impl Workers {
    /// Starts claiming (unless `jobs.workers` is 0).
    pub fn start(state: AppState) -> Self {
        let (stop, cut, runs) = (
            CancellationToken::new(),
            CancellationToken::new(),
            TaskTracker::new(),
        );
        let claims = tokio::spawn(claim(state, stop.clone(), cut.clone(), runs.clone()));
        Self {
            stop,
            cut,
            runs,
            claims,
        }
    }

    /// What cuts the runs short, for the server's own end of the grace period.
    pub fn cutter(&self) -> Cutter {
        Cutter {
            cut: self.cut.clone(),
            runs: self.runs.clone(),
        }
    }

    /// Stops claiming; the runs get `grace` to finish, then are cut (their jobs queued
    /// again for the next worker, here after a restart or on another replica).
    pub async fn shutdown(self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        self.stop.cancel();
        let cutter = self.cutter();
        let _ = self.claims.await;
        cutter.runs.close();
        if tokio::time::timeout_at(deadline, cutter.runs.wait())
            .await
            .is_err()
        {
            cutter.cut().await;
        }
    }
}

/// Cuts this replica's job runs short (see [`Workers::cutter`]).
#[derive(Clone)]
pub struct Cutter {
    cut: CancellationToken,
    runs: TaskTracker,
}

impl Cutter {
    /// Cuts the runs still going and waits (briefly) until their jobs are queued again.
    /// The server does this before it drains its connections: a run cut by the drain
    /// would end its job as failed rather than queue it again.
    pub async fn cut(&self) {
        if self.runs.is_empty() || self.cut.is_cancelled() {
            return;
        }
        tracing::warn!(
            "job runs did not finish within the shutdown grace period; queuing them again"
        );
        self.cut.cancel();
        self.runs.close();
        let _ = tokio::time::timeout(CUT_WAIT, self.runs.wait()).await;
    }
}

async fn claim(
    state: AppState,
    stop: CancellationToken,
    cut: CancellationToken,
    runs: TaskTracker,
) {
    let settings = state.config().jobs.clone();
    if settings.workers == 0 {
        return;
    }
    let slots = Arc::new(Semaphore::new(settings.workers as usize));
    let poll = Duration::from_millis(settings.poll_interval_ms);
    let lease_ms = i64::try_from(settings.lease_ms).unwrap_or(i64::MAX);
    let hub = state.jobs().clone();
    let mut failures = STORE_RETRY.pauses();
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
            () = stop.cancelled() => return,
        };
        let claimed = state
            .store()
            .jobs()
            .claim(hub.owner(), now_unix_ms(), lease_ms)
            .await;
        let pause = match claimed {
            Ok(Some(job)) => {
                failures.reset();
                runs.spawn(run::run(state.clone(), job, cut.clone(), slot));
                continue;
            }
            Ok(None) => {
                failures.reset();
                poll
            }
            Err(err) => {
                tracing::warn!(error = %err, "could not claim a job");
                failures.next_pause()
            }
        };
        drop(slot);
        tokio::select! {
            () = hub.next_queued() => {}
            () = tokio::time::sleep(pause) => {}
            () = stop.cancelled() => return,
        }
    }
}
