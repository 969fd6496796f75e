//! The request metadata log's writer: requests hand their [`RequestLogRow`] to a
//! [`RequestLog`] handle, which never blocks and never awaits the database; one
//! background task writes the rows to the store in batches.
//!
//! Lifecycle:
//!
//! ```text
//! let log = RequestLog::start(store.clone());     // spawns the writer (inside a runtime)
//! log.record(row);                                // per request: queue it, return at once
//! log.flush().await;                              // optional: wait until what was queued is written
//! let stats = log.close().await;                  // at shutdown: drain, write, stop
//! ```
//!
//! - **Batching**: a batch is written when its first row has waited
//!   [`RequestLogConfig::max_delay`], in writes of at most [`RequestLogConfig::batch_rows`]
//!   rows (so a row reaches the database within about `max_delay` plus the writes).
//! - **Back-pressure**: the queue is bounded ([`RequestLogConfig::capacity`]); when it is
//!   full (the database is far behind) a new row is dropped and counted, with a warning
//!   at most once a second. Requests are never slowed down by the log.
//! - **Unauthenticated noise**: of the requests refused before anybody was
//!   authenticated, one a second ([`UNAUTHENTICATED_SAMPLE_EVERY`]) is recorded; the
//!   rest are only counted (see `request_record`). Noise thus puts at most one row a
//!   second into the queue, and can never fill it with rows that push out the served
//!   requests'.
//! - **Failures**: a failed batch is retried with back-off
//!   ([`RequestLogConfig::write_attempts`] attempts in all), then dropped, counted and
//!   logged with its row count only (never row contents).
//! - **Shutdown**: [`RequestLog::close`] (on any clone) stops accepting rows, writes
//!   everything still queued and waits for the writer to finish: nothing is lost on a
//!   clean stop. Rows recorded on other clones after that are dropped and counted. If
//!   every handle is dropped without `close`, the writer also drains and stops on its
//!   own, but nobody waits for it.
//!
//! The writer task is tracked: its `JoinHandle` lives in the handles' shared state and
//! `close` awaits it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::batching::{self, Batching, Queue, Sink};
use crate::store::{RequestLogRow, Store, StoreError};
use crate::throttled::Throttled;

/// At most one request refused before authentication is logged and recorded this often.
pub const UNAUTHENTICATED_SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Tuning of the writer; [`Default`] is what the gateway uses.
#[derive(Debug, Clone)]
pub struct RequestLogConfig {
    /// Rows waiting to be written at most; beyond that new rows are dropped.
    pub capacity: usize,
    /// Rows per write (one transaction) at most.
    pub batch_rows: usize,
    /// How long the first row of a batch waits for the rest (the most a row waits).
    pub max_delay: Duration,
    /// Attempts to write a batch (the first one included) before it is dropped.
    pub write_attempts: u32,
    /// Wait before the first retry; doubled for each further one.
    pub retry_delay: Duration,
}

impl Default for RequestLogConfig {
    fn default() -> Self {
        Self {
            capacity: 65_536,
            batch_rows: 256,
            max_delay: Duration::from_millis(200),
            write_attempts: 4,
            retry_delay: Duration::from_millis(100),
        }
    }
}

/// Counters of a [`RequestLog`] since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestLogStats {
    /// Rows written to the store (or skipped there as already logged).
    pub written: u64,
    /// Rows refused by [`RequestLog::record`]: the queue was full or the log closed.
    pub dropped: u64,
    /// Rows of batches that could not be written after every attempt.
    pub failed: u64,
}

/// A handle on the request log: cheap to clone, shared by every request.
#[derive(Clone)]
pub struct RequestLog {
    queue: Queue<RequestLogRow>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RequestLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestLog")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

struct Shared {
    counters: Arc<Counters>,
    /// Tells the writer to stop taking rows, drain and stop.
    stop: CancellationToken,
    /// The writer task, until someone awaits it in `close`. A tokio mutex: a second
    /// `close` waits for the first to finish.
    writer: tokio::sync::Mutex<Option<JoinHandle<()>>>,
    /// For the once-a-second warning about dropped rows.
    started: Instant,
    /// Milliseconds after `started` of the last warning, plus one (0: never warned).
    last_warning_ms: AtomicU64,
    /// Which unauthenticated refusal is the sample.
    unauthenticated: Throttled,
}

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> RequestLogStats {
        RequestLogStats {
            written: self.written.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

impl RequestLog {
    /// Starts the writer with the default settings. Must be called inside a Tokio
    /// runtime (it spawns the writer task).
    pub fn start(store: Arc<dyn Store>) -> Self {
        Self::start_with(store, RequestLogConfig::default())
    }

    /// Starts the writer with these settings (values below 1 are taken as 1).
    pub fn start_with(store: Arc<dyn Store>, config: RequestLogConfig) -> Self {
        let batching = Batching {
            batch_rows: config.batch_rows,
            max_delay: config.max_delay,
        };
        let (queue, inbox) = batching::channel(config.capacity, batching);
        let counters = Arc::new(Counters::default());
        let stop = CancellationToken::new();
        let writer = Writer {
            store,
            config,
            counters: counters.clone(),
        };
        let handle = tokio::spawn(batching::run(writer, inbox, stop.clone()));
        Self {
            queue,
            shared: Arc::new(Shared {
                counters,
                stop,
                writer: tokio::sync::Mutex::new(Some(handle)),
                started: Instant::now(),
                last_warning_ms: AtomicU64::new(0),
                unauthenticated: Throttled::new(UNAUTHENTICATED_SAMPLE_EVERY),
            }),
        }
    }

    /// Queues a row for writing and returns at once; never waits for the database or for
    /// room in the queue. When the queue is full or the log closed, the row is dropped and
    /// counted in [`RequestLogStats::dropped`].
    pub fn record(&self, row: RequestLogRow) {
        match self.queue.try_row(row) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => self.dropped("the queue is full"),
            Err(mpsc::error::TrySendError::Closed(_)) => self.dropped("the log is closed"),
        }
    }

    /// For a request refused before anybody was authenticated: `Some(n)` when it is the
    /// sample to log and record (at most one every [`UNAUTHENTICATED_SAMPLE_EVERY`]),
    /// `n` being how many were left out since the last one; `None`: leave it out.
    pub fn sample_unauthenticated(&self) -> Option<u64> {
        self.shared.unauthenticated.note()
    }

    /// Resolves once every row recorded before the call (on any clone) has been written,
    /// or given up after failed attempts (see [`RequestLogStats::failed`]). Returns at once
    /// when the log is closed. Waits for room in the queue, so do not call it on the
    /// request path.
    pub async fn flush(&self) {
        self.queue.flush().await;
    }

    /// Stops the log: no more rows are taken, everything queued is written, and the
    /// writer task has finished when this returns. Closing again (or from another clone)
    /// waits for the same end.
    pub async fn close(self) -> RequestLogStats {
        self.shared.stop.cancel();
        let mut writer = self.shared.writer.lock().await;
        if let Some(handle) = writer.take()
            && let Err(err) = handle.await
        {
            tracing::error!(error = %err, "request log writer failed");
        }
        drop(writer);
        self.stats()
    }

    /// What the log has written, dropped and failed so far.
    pub fn stats(&self) -> RequestLogStats {
        self.shared.counters.snapshot()
    }

    fn dropped(&self, why: &'static str) {
        let dropped = self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        let now_ms = u64::try_from(self.shared.started.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        let last = self.shared.last_warning_ms.load(Ordering::Relaxed);
        if (last == 0 || now_ms.saturating_sub(last) >= 1000)
            && self
                .shared
                .last_warning_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                dropped_total = dropped,
                "request log: dropped a row because {why}"
            );
        }
    }
}

/// The background task's sink: writes a batch with a few attempts, then drops it.
struct Writer {
    store: Arc<dyn Store>,
    config: RequestLogConfig,
    counters: Arc<Counters>,
}

impl Sink<RequestLogRow> for Writer {
    async fn write(&mut self, batch: &mut Vec<RequestLogRow>) {
        let rows = u64::try_from(batch.len()).unwrap_or(u64::MAX);
        let attempts = self.config.write_attempts.max(1);
        let mut pauses = Backoff::new(self.config.retry_delay, Duration::MAX).pauses();
        for attempt in 1..=attempts {
            match self.store.append_request_log(batch).await {
                Ok(()) => {
                    self.counters.written.fetch_add(rows, Ordering::Relaxed);
                    batch.clear();
                    return;
                }
                Err(err) if attempt < attempts => {
                    tracing::warn!(
                        rows,
                        attempt,
                        error = %ErrorChain(&err),
                        "request log: writing a batch failed; retrying"
                    );
                    tokio::time::sleep(pauses.next_pause()).await;
                }
                Err(err) => {
                    tracing::error!(
                        rows,
                        attempts,
                        error = %ErrorChain(&err),
                        "request log: writing a batch failed; its rows are dropped"
                    );
                }
            }
        }
        self.counters.failed.fetch_add(rows, Ordering::Relaxed);
        batch.clear();
    }
}

/// An error and its sources, by their `Display` (which, unlike some `Debug` output, does
/// not carry the values of a refused row).
struct ErrorChain<'a>(&'a StoreError);

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = std::error::Error::source(self.0);
        while let Some(err) = source {
            write!(f, ": {err}")?;
            source = err.source();
        }
        Ok(())
    }
}
