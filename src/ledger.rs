//! The usage ledger's write-behind writer. A settled request hands its [`UsageRow`] to
//! [`Ledger::record`], which never waits for the store; one background task commits
//! the rows in batches (group commit: the rows settled in one [`LedgerConfig::max_delay`]
//! from the first, in transactions of at most [`LedgerConfig::batch_rows`] rows).
//!
//! - **Nothing is dropped.** A batch that fails is retried, with back-off, until the
//!   store takes it (rows are idempotent on their request id, so a retry after an
//!   unclear commit counts nothing twice). Only a row the store refuses as invalid is
//!   given up, logged with its request id.
//! - **Bounded.** Rows not yet committed are counted; once they reach
//!   [`LedgerConfig::backlog_limit`] (the store has been away for a while),
//!   [`Ledger::backlogged`] says so and new requests are refused (503
//!   `store_unavailable`) rather than run with usage that could not be kept.
//! - **What a crash can lose**: the rows not yet committed — in normal operation those
//!   settled in the last `max_delay` (20 ms by default) plus the batch being written.
//!   A clean stop loses nothing: [`Ledger::close`] writes everything first (retrying
//!   within its deadline while the store is away). With the shared limiter, a crash
//!   loses nothing either: Redis journals each row as it settles the counters, the
//!   writer tells it ([`Committed`]) once the row is in the store, and the rows a dead
//!   replica left are adopted by a live one (`admission::redis`'s journal).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::batching::{self, Batching, Message, Queue, Sink};
use crate::store::{Store, StoreError, UsageRow};

/// After the close deadline, how long the writer gets to stop before it is aborted.
const CLOSE_AFTER_GIVING_UP: Duration = Duration::from_secs(1);
/// The longest [`Ledger::flush_within`] callers wait (seeding a counter from the
/// ledger): beyond it, the store is taken as away.
pub const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// Tuning of the writer; [`Default`] is what the gateway uses.
#[derive(Debug, Clone)]
pub struct LedgerConfig {
    /// Rows per transaction at most.
    pub batch_rows: usize,
    /// How long the first row of a batch waits for the rest (the most a row waits).
    pub max_delay: Duration,
    /// Rows recorded but not yet committed beyond which new requests are refused.
    pub backlog_limit: usize,
    /// Pauses between attempts to write a failing batch.
    pub retry: Backoff,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            batch_rows: 512,
            max_delay: Duration::from_millis(20),
            backlog_limit: 100_000,
            retry: Backoff::new(Duration::from_millis(50), Duration::from_secs(2)),
        }
    }
}

/// Counters of a [`Ledger`] since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerStats {
    /// Rows committed (or found already there).
    pub written: u64,
    /// Rows recorded and not yet committed.
    pub pending: u64,
    /// Rows the store refused as invalid, or recorded after the ledger closed.
    pub lost: u64,
}

/// Told which rows the store now has (or refused for good), so that a copy kept
/// elsewhere until then can be forgotten.
pub trait Committed: Send + Sync + 'static {
    /// Must not wait: called by the writer between two batches.
    fn committed(&self, request_ids: Vec<String>);
}

/// Where the writer reports its commits, set once after start.
type Listener = Arc<OnceLock<Arc<dyn Committed>>>;

/// A handle on the ledger writer: cheap to clone, shared by every request.
#[derive(Clone)]
pub struct Ledger(Arc<Shared>);

struct Shared {
    queue: Queue<UsageRow>,
    counters: Arc<Counters>,
    backlog_limit: usize,
    stop: CancellationToken,
    /// Ends the writer's retries (the close deadline passed).
    give_up: CancellationToken,
    writer: tokio::sync::Mutex<Option<JoinHandle<()>>>,
    listener: Listener,
}

#[derive(Default)]
struct Counters {
    pending: AtomicUsize,
    written: AtomicU64,
    lost: AtomicU64,
}

impl Ledger {
    /// Starts the writer with the default settings (inside a Tokio runtime).
    pub fn start(store: Arc<dyn Store>) -> Self {
        Self::start_with(store, LedgerConfig::default())
    }

    pub fn start_with(store: Arc<dyn Store>, config: LedgerConfig) -> Self {
        let batching = Batching {
            batch_rows: config.batch_rows,
            max_delay: config.max_delay,
        };
        // Twice the backlog limit: requests admitted before the limit was reached
        // still settle into it; beyond that `record` counts a row as lost.
        let (queue, inbox) =
            batching::channel(config.backlog_limit.max(1).saturating_mul(2), batching);
        let counters = Arc::new(Counters::default());
        let stop = CancellationToken::new();
        let give_up = CancellationToken::new();
        let listener = Listener::default();
        let writer = Writer {
            store,
            retry: config.retry,
            counters: Arc::clone(&counters),
            give_up: give_up.clone(),
            listener: Arc::clone(&listener),
        };
        let handle = tokio::spawn(batching::run(writer, inbox, stop.clone()));
        Self(Arc::new(Shared {
            queue,
            counters,
            backlog_limit: config.backlog_limit,
            stop,
            give_up,
            writer: tokio::sync::Mutex::new(Some(handle)),
            listener,
        }))
    }

    /// Reports every commit from now on to `listener` (set once; later calls are
    /// ignored).
    pub fn report_commits_to(&self, listener: Arc<dyn Committed>) {
        let _ = self.0.listener.set(listener);
    }

    /// Queues a settled request's row and returns at once.
    pub fn record(&self, row: UsageRow) {
        let counters = &self.0.counters;
        counters.pending.fetch_add(1, Ordering::AcqRel);
        if let Err(err) = self.0.queue.try_row(row) {
            counters.pending.fetch_sub(1, Ordering::AcqRel);
            counters.lost.fetch_add(1, Ordering::Relaxed);
            let row = match err {
                mpsc::error::TrySendError::Full(Message::Row(row))
                | mpsc::error::TrySendError::Closed(Message::Row(row)) => row,
                _ => return,
            };
            tracing::error!(request_id = %row.request_id, key_id = row.key_id, tokens = row.prompt_tokens + row.completion_tokens, "usage ledger: a row could not be queued (the ledger is closed or far behind); it is lost");
        }
    }

    /// Whether [`Ledger::close`] has begun (no more rows are taken).
    pub fn is_closing(&self) -> bool {
        self.0.stop.is_cancelled()
    }

    /// Whether rows waiting to be committed have reached the backlog limit.
    pub fn backlogged(&self) -> bool {
        self.0.counters.pending.load(Ordering::Acquire) >= self.0.backlog_limit
    }

    /// [`Ledger::flush`], given up after `limit`: whether everything recorded before
    /// the call was committed in time.
    pub async fn flush_within(&self, limit: Duration) -> bool {
        tokio::time::timeout(limit, self.flush()).await.is_ok()
    }

    /// Resolves once every row recorded before the call has been committed (waiting
    /// for as long as the store is away), or at once when the ledger is closed.
    pub async fn flush(&self) {
        self.0.queue.flush().await;
    }

    /// Stops the ledger: no more rows are taken and everything queued is committed,
    /// retried for up to `deadline` while the store is away; what could not be
    /// written by then is logged (its count) and counted as pending.
    pub async fn close(&self, deadline: Duration) -> LedgerStats {
        self.0.stop.cancel();
        let mut writer = self.0.writer.lock().await;
        if let Some(mut handle) = writer.take() {
            let finished = tokio::time::timeout(deadline, &mut handle).await.is_ok();
            if !finished {
                // No attempt starts after this and the one under way is dropped, so the
                // writer ends promptly; the abort is for a writer that still does not.
                self.0.give_up.cancel();
                if tokio::time::timeout(CLOSE_AFTER_GIVING_UP, &mut handle)
                    .await
                    .is_err()
                {
                    handle.abort();
                }
                tracing::error!(
                    rows = self.0.counters.pending.load(Ordering::Acquire),
                    "usage ledger: the store did not take the last rows before exit; they are lost"
                );
            }
        }
        drop(writer);
        self.stats()
    }

    pub fn stats(&self) -> LedgerStats {
        let counters = &self.0.counters;
        LedgerStats {
            written: counters.written.load(Ordering::Relaxed),
            pending: counters.pending.load(Ordering::Acquire) as u64,
            lost: counters.lost.load(Ordering::Relaxed),
        }
    }
}

/// The background task's sink: commits a batch, retrying until the store takes it.
struct Writer {
    store: Arc<dyn Store>,
    retry: Backoff,
    counters: Arc<Counters>,
    give_up: CancellationToken,
    listener: Listener,
}

impl Sink<UsageRow> for Writer {
    async fn write(&mut self, batch: &mut Vec<UsageRow>) {
        match self.commit(batch).await {
            Ok(()) => {}
            // One bad row must not hold the others back: write them one by one and give
            // up only the refused ones.
            Err(_) if batch.len() > 1 => {
                for row in std::mem::take(batch) {
                    let single = [row];
                    if let Err(message) = self.commit(&single).await {
                        self.lost(&single[0], &message);
                    }
                }
            }
            Err(message) => {
                if let Some(row) = batch.first() {
                    self.lost(row, &message);
                }
            }
        }
        batch.clear();
    }
}

impl Writer {
    /// Commits `rows`, retrying until the store takes them (or the close deadline
    /// passed: then they stay pending). `Err`: the store refused them as invalid (or
    /// broke a constraint with them: retrying could never help).
    async fn commit(&self, rows: &[UsageRow]) -> Result<(), String> {
        let mut pauses = self.retry.pauses();
        let mut failures = 0u32;
        loop {
            // Past the close deadline no attempt starts, and one under way is dropped:
            // a store that does not answer must not hold the exit.
            let Some(attempt) = self
                .give_up
                .run_until_cancelled(self.store.record_usages(rows))
                .await
            else {
                return Ok(());
            };
            match attempt.map_err(refused_as_invalid) {
                Ok(()) => {
                    self.counters
                        .pending
                        .fetch_sub(rows.len(), Ordering::AcqRel);
                    self.counters
                        .written
                        .fetch_add(rows.len() as u64, Ordering::Relaxed);
                    self.report(rows);
                    return Ok(());
                }
                Err(StoreError::Invalid(message)) => return Err(message),
                Err(err) => {
                    failures += 1;
                    if failures == 1 {
                        tracing::warn!(rows = rows.len(), error = %err, "usage ledger: writing a batch failed; retrying until the store takes it");
                    }
                    let pause = pauses.next_pause();
                    let waited = self
                        .give_up
                        .run_until_cancelled(tokio::time::sleep(pause))
                        .await;
                    if waited.is_none() {
                        return Ok(());
                    }
                }
            }
        }
    }

    fn lost(&self, row: &UsageRow, message: &str) {
        self.counters.pending.fetch_sub(1, Ordering::AcqRel);
        self.counters.lost.fetch_add(1, Ordering::Relaxed);
        tracing::error!(request_id = %row.request_id, %message, "usage ledger: the store refused a row; it is lost");
        // Kept elsewhere, it would be offered to the store again and again.
        self.report(std::slice::from_ref(row));
    }

    fn report(&self, rows: &[UsageRow]) {
        if let Some(listener) = self.listener.get() {
            listener.committed(rows.iter().map(|r| r.request_id.clone()).collect());
        }
    }
}

/// A database's refusal of the rows themselves (a constraint they break) as
/// [`StoreError::Invalid`]: retrying the same rows would fail for ever and hold back
/// every row behind them.
fn refused_as_invalid(err: StoreError) -> StoreError {
    match err {
        StoreError::Database(sqlx::Error::Database(db))
            if matches!(
                db.kind(),
                sqlx::error::ErrorKind::ForeignKeyViolation
                    | sqlx::error::ErrorKind::CheckViolation
                    | sqlx::error::ErrorKind::NotNullViolation
            ) =>
        {
            StoreError::Invalid(db.message().to_owned())
        }
        other => other,
    }
}
