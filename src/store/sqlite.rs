//! The SQLite backend: the embedded default.

use std::str::FromStr as _;
use std::sync::LazyLock;
use std::time::Duration;

use sqlx::SqlitePool;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use super::backend::Store;
use super::columns::{
    KeySelector, LimitColumns, LogColumns, UpdateColumns, UsageColumns, convert, insert_error,
    now_unix, text_column,
};
use super::records::{
    KeyChange, KeyRecord, LimitOverrides, LimitUpdate, RequestLogRow, RequestQuery, SpendQuery,
    SpendRow, StoreError, UsageRow,
};
use crate::backoff::Backoff;
use crate::key_secret::NewKey;

static MIGRATOR: LazyLock<Migrator> =
    LazyLock::new(|| super::migrations::rollback_tolerant(sqlx::migrate!("migrations/sqlite")));

/// How long a statement waits for another connection's (or process's) write lock
/// before failing with "database is locked".
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Page cache per connection: negative means KiB (32 MiB).
const CACHE_SIZE_PRAGMA: &str = "-32768";
/// Bytes of the database file mapped into memory (at most; the file may be smaller).
const MMAP_SIZE: u64 = 256 << 20;
/// Connections to a file database. WAL lets readers run beside the one writer.
const FILE_POOL_SIZE: u32 = 4;
/// Opening a fresh file races when two processes (the server and the CLI) do it at
/// once; see [`is_open_race`]. The loser tries again, after 50, 100, 150… ms.
const OPEN_ATTEMPTS: u32 = 5;
const OPEN_RETRY_DELAY: Duration = Duration::from_millis(50);

/// A store in one SQLite file (or in memory).
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating if needed) the database for a `sqlite:` URL and migrates it.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::InvalidUrl(e.to_string()))?
            .busy_timeout(BUSY_TIMEOUT);

        let memory = is_memory(url);
        let options = if memory {
            options
        } else {
            let path = options.get_filename().to_path_buf();
            if path.as_os_str().is_empty() {
                return Err(StoreError::InvalidUrl(
                    "a sqlite URL needs a file path (sqlite://path/to/file.db) or :memory:"
                        .to_owned(),
                ));
            }
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                tokio::fs::create_dir_all(parent).await.map_err(|source| {
                    StoreError::CreateDir {
                        path: parent.to_path_buf(),
                        source,
                    }
                })?;
            }
            options
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                // In WAL mode NORMAL cannot corrupt the database; a power loss may drop
                // the last commits, which a gateway's key/usage data can afford.
                .synchronous(SqliteSynchronous::Normal)
                // The ledger's and the request log's unique request-id indexes take
                // inserts at random places: with SQLite's default 2 MiB page cache a
                // grown database reads pages back on every commit (measured: a third
                // fewer requests per second at 280,000 rows). Keep the hot pages in
                // memory, and map the file rather than read it.
                .pragma("cache_size", CACHE_SIZE_PRAGMA)
                .pragma("mmap_size", MMAP_SIZE.to_string())
        };

        let mut pauses = Backoff::new(OPEN_RETRY_DELAY, OPEN_RETRY_DELAY * 8).pauses();
        let mut attempt = 1;
        loop {
            match Self::open(options.clone(), memory).await {
                Err(err) if attempt < OPEN_ATTEMPTS && is_open_race(&err) => {
                    tokio::time::sleep(pauses.next_pause()).await;
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    async fn open(options: SqliteConnectOptions, memory: bool) -> Result<Self, StoreError> {
        let pool = if memory {
            // Every connection to a named in-memory database shares it, and it vanishes
            // with the last one: keep exactly one connection, forever. (One connection
            // also avoids shared-cache table locks, which the busy timeout does not cover.)
            SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(options)
                .await?
        } else {
            SqlitePoolOptions::new()
                .max_connections(FILE_POOL_SIZE)
                .connect_with(options)
                .await?
        };
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    /// The connection pool, for code that needs the database directly.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

/// Whether a `sqlite:` URL names an in-memory database (`sqlite::memory:`,
/// `sqlite://:memory:`, or `?mode=memory`).
pub(super) fn is_memory(url: &str) -> bool {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    let (database, params) = rest.split_once('?').unwrap_or((rest, ""));
    database == ":memory:" || params.split('&').any(|p| p == "mode=memory")
}

/// Whether opening failed in a way that another process opening the same fresh file at
/// the same moment causes, and that trying again resolves:
/// - switching a new file to WAL needs an exclusive lock that the busy timeout does not
///   wait for, so the loser gets SQLITE_BUSY at once;
/// - SQLite migrations take no lock, so the loser's `CREATE TABLE` fails ("already
///   exists"); on the next attempt it finds the winner's migrations recorded and has
///   nothing left to do. (A migration that truly fails fails every attempt.)
fn is_open_race(err: &StoreError) -> bool {
    match err {
        StoreError::Database(err) => is_busy(err),
        StoreError::Migrate(MigrateError::Execute(_) | MigrateError::ExecuteMigration(..)) => true,
        _ => false,
    }
}

/// SQLITE_BUSY or SQLITE_LOCKED, extended codes included.
fn is_busy(err: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = err else {
        return false;
    };
    db.code()
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

impl_workbench_store!(SqliteStore, sqlx::Sqlite);

/// Most rows in one `INSERT`: 64 rows of at most 14 columns stay far below SQLite's limit
/// on bound parameters (32,766). A power of two (see [`insert_chunks`]).
const ROWS_PER_INSERT: usize = 64;
const _: () = assert!(ROWS_PER_INSERT.is_power_of_two());

/// Splits a batch into multi-row `INSERT`s of 64, 32, 16 … 1 rows (largest first).
///
/// Why not the batch's own size: every size is another statement, and preparing a 64-row
/// `INSERT` of 14 columns costs SQLite ~370,000 instructions. With sizes from seven, each
/// table's inserts stay in every connection's statement cache (100 statements), so a
/// batch binds and steps statements already prepared; with a size per batch (1 to 64)
/// they did not fit and were prepared again and again.
fn insert_chunks<T>(mut rows: &[T]) -> impl Iterator<Item = &[T]> {
    std::iter::from_fn(move || {
        let size = ROWS_PER_INSERT.min(1 << rows.len().checked_ilog2()?);
        let (chunk, rest) = rows.split_at(size);
        rows = rest;
        Some(chunk)
    })
}

/// The text of a table's multi-row `INSERT` for each size [`insert_chunks`] makes, made
/// once: building it for every batch (a placeholder formatted per value) cost ~3,500
/// instructions a request.
struct InsertSql([String; ROWS_PER_INSERT.ilog2() as usize + 1]);

impl InsertSql {
    /// `head` is `INSERT INTO table (columns…)`; a repeated request id is skipped.
    fn new(head: &str, columns: usize) -> Self {
        let row = format!("({})", vec!["?"; columns].join(", "));
        Self(std::array::from_fn(|log2| {
            let rows = vec![row.as_str(); 1 << log2].join(", ");
            format!("{head} VALUES {rows} ON CONFLICT (request_id) DO NOTHING")
        }))
    }

    /// For a chunk of `rows` rows (a power of two up to [`ROWS_PER_INSERT`]).
    fn rows(&self, rows: usize) -> &str {
        &self.0[rows.ilog2() as usize]
    }
}

static USAGE_INSERT: std::sync::LazyLock<InsertSql> = std::sync::LazyLock::new(|| {
    InsertSql::new(
        "INSERT INTO usage_ledger \
         (key_id, request_id, month, prompt_tokens, completion_tokens, created_at)",
        6,
    )
});

static REQUEST_LOG_INSERT: std::sync::LazyLock<InsertSql> = std::sync::LazyLock::new(|| {
    InsertSql::new(
        concat!("INSERT INTO request_log (", request_log_columns!(), ")"),
        15,
    )
});

/// A multi-row `INSERT`, its values bound.
type Insert<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>;

/// Runs `insert` (one chunk's statement) for each chunk of `rows` ([`insert_chunks`]):
/// one statement for many rows costs a fraction of one statement per row. A batch of
/// one chunk — every batch while requests come one at a time — is one statement, atomic
/// by itself; a `BEGIN` and a `COMMIT` around it would be two more statements, each a
/// round trip to the driver's worker thread. More chunks go in one transaction.
async fn insert_all<'q, T>(
    pool: &SqlitePool,
    rows: &'q [T],
    insert: impl Fn(&'q [T]) -> Insert<'q>,
) -> Result<(), sqlx::Error> {
    let chunks: Vec<_> = insert_chunks(rows).collect();
    match chunks[..] {
        [] => return Ok(()),
        [chunk] => return insert(chunk).execute(pool).await.map(drop),
        _ => {}
    }
    let mut tx = pool.begin().await?;
    for chunk in chunks {
        insert(chunk).execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// The ledger's insert of checked rows.
fn insert_usage<'q>(rows: &'q [(&UsageRow, UsageColumns)]) -> Insert<'q> {
    let mut insert = sqlx::query(USAGE_INSERT.rows(rows.len()));
    for (row, counts) in rows {
        insert = insert
            .bind(row.key_id)
            .bind(row.request_id.as_str())
            .bind(row.month.as_str())
            .bind(counts.prompt_tokens)
            .bind(counts.completion_tokens)
            .bind(row.created_at);
    }
    insert
}

/// The request log's insert.
fn insert_request_log(rows: &[RequestLogRow]) -> Insert<'_> {
    let mut insert = sqlx::query(REQUEST_LOG_INSERT.rows(rows.len()));
    for row in rows {
        let columns = LogColumns::encode(row);
        insert = insert
            .bind(row.request_id.as_str())
            .bind(row.created_at_ms)
            .bind(row.key_id)
            .bind(row.key_prefix.as_deref())
            .bind(row.email.as_deref())
            .bind(columns.client_ip)
            .bind(row.endpoint.as_str())
            .bind(row.model.as_deref())
            .bind(columns.prompt_tokens)
            .bind(columns.completion_tokens)
            .bind(columns.status)
            .bind(row.error_code.as_deref())
            .bind(columns.latency_ms)
            .bind(row.workload.as_deref())
            .bind(columns.queue_wait_ms);
    }
    insert
}

impl_store!(SqliteStore, sqlx::Sqlite {
    async fn record_usages(&self, rows: &[UsageRow]) -> Result<(), StoreError> {
        // Every row checked before anything is written: all or none.
        let rows = rows
            .iter()
            .map(|row| Ok((row, UsageColumns::encode(row)?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        insert_all(&self.pool, &rows, insert_usage).await?;
        Ok(())
    }

    async fn append_request_log(&self, rows: &[RequestLogRow]) -> Result<(), StoreError> {
        insert_all(&self.pool, rows, insert_request_log).await?;
        Ok(())
    }
});

impl_job_store!(SqliteStore, sqlx::Sqlite, "", "" {});

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::{ROWS_PER_INSERT, insert_chunks, is_memory};

    /// Every batch size from 0 to 300 is written whole and in order, largest statements
    /// first, with statements of seven sizes in all (so they stay prepared).
    #[test]
    fn batches_split_into_few_statement_sizes() {
        let mut sizes = BTreeSet::new();
        for n in 0..=300 {
            let rows: Vec<usize> = (0..n).collect();
            let chunks: Vec<&[usize]> = insert_chunks(&rows).collect();
            assert_eq!(chunks.concat(), rows, "batch of {n}");
            let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
            assert!(lens.is_sorted_by(|a, b| a >= b), "batch of {n}: {lens:?}");
            assert!(
                lens.len() <= n / ROWS_PER_INSERT + 6,
                "batch of {n}: {lens:?}"
            );
            sizes.extend(lens);
        }
        assert_eq!(
            sizes.into_iter().collect::<Vec<_>>(),
            [1, 2, 4, 8, 16, 32, 64]
        );
    }

    #[test]
    fn memory_urls() {
        assert!(is_memory("sqlite::memory:"));
        assert!(is_memory("sqlite://:memory:"));
        assert!(is_memory("sqlite://?mode=memory"));
        assert!(!is_memory("sqlite://data/fleetgate.db"));
        assert!(!is_memory("sqlite:///var/lib/fleetgate/memory.db"));
    }
}
