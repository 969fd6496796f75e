//! The PostgreSQL backend.

use std::str::FromStr as _;
use std::sync::LazyLock;
use std::time::Duration;

use sqlx::Connection as _;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};

use super::columns::{
    KeySelector, LimitColumns, LogColumns, UpdateColumns, UsageColumns, convert, insert_error,
    now_unix, text_column,
};
use futures_util::StreamExt as _;

use super::backend::Store;
use super::records::{
    KeyChange, KeyRecord, KeySignals, LimitOverrides, LimitUpdate, RequestLogRow, RequestQuery,
    SpendQuery, SpendRow, StoreError, UsageRow,
};
use crate::key_secret::NewKey;

static MIGRATOR: LazyLock<Migrator> =
    LazyLock::new(|| super::migrations::rollback_tolerant(sqlx::migrate!("migrations/postgres")));

const POOL_SIZE: u32 = 10;
/// The channel the key feed trigger (migration 0003) notifies.
const KEY_FEED_CHANNEL: &str = "fleetgate_keys";
/// The channel a job's end is announced on, with its id (see `job_sql.rs`).
const JOB_END_CHANNEL: &str = "fleetgate_jobs";
/// How long a query waits for a free connection before failing (so a health check on
/// an unreachable database answers instead of hanging).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the first connection failed, said once: a database that does not exist by its
/// name (the server's default is the user's name), else the server's or the network's
/// own words. (sqlx's error repeats its cause after itself, and a server error carries
/// the line of the server's source that raised it, of no use to the reader.)
fn connect_error(err: sqlx::Error, options: &PgConnectOptions) -> StoreError {
    match &err {
        // SQLSTATE 3D000, invalid_catalog_name: no database of that name.
        sqlx::Error::Database(e) if e.code().is_some_and(|code| code == "3D000") => {
            let name = options.get_database().unwrap_or(options.get_username());
            StoreError::NoDatabase(name.to_owned())
        }
        sqlx::Error::Database(e) => StoreError::Connect(e.message().to_owned()),
        sqlx::Error::Io(e) => StoreError::Connect(format!("cannot reach the server: {e}")),
        sqlx::Error::Tls(e) => StoreError::Connect(format!("TLS: {e}")),
        _ => err.into(),
    }
}

/// A store in a PostgreSQL database.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// Connects to a `postgres://` or `postgresql://` URL and migrates the database.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options =
            PgConnectOptions::from_str(url).map_err(|e| StoreError::InvalidUrl(e.to_string()))?;
        // One connection of our own first, which runs the migrations: a pool that cannot
        // connect says only "pool timed out" after its acquire timeout, hiding why
        // (refused, unknown host, authentication failed, no such database).
        // It is told to send warnings and errors only: every start's `CREATE TABLE IF
        // NOT EXISTS _sqlx_migrations` otherwise logs the notice `relation
        // "_sqlx_migrations" already exists, skipping`, which says nothing. The pool's
        // connections keep the server's setting.
        let migrating = options
            .clone()
            .options([("client_min_messages", "warning")]);
        let mut first =
            tokio::time::timeout(ACQUIRE_TIMEOUT, PgConnection::connect_with(&migrating))
                .await
                .map_err(|_| sqlx::Error::PoolTimedOut)?
                .map_err(|err| connect_error(err, &options))?;
        // Migrations take an advisory lock, so concurrent starts are safe.
        MIGRATOR.run(&mut first).await?;
        first.close().await?;
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await?;
        Ok(Self { pool })
    }

    /// The connection pool, for code that needs the database directly.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A listener on a connection of its own, outside the pool: a listener holds its
    /// connection for as long as it listens, which would leave the pool one short for
    /// requests. `None` when the database cannot be reached now.
    async fn own_listener(&self) -> Option<sqlx::postgres::PgListener> {
        let own = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy_with((*self.pool.connect_options()).clone());
        sqlx::postgres::PgListener::connect_with(&own).await.ok()
    }
}

impl_workbench_store!(PostgresStore, sqlx::Postgres);

impl_store!(PostgresStore, sqlx::Postgres {
    async fn key_change_signals(&self) -> Option<KeySignals> {
        let mut listener = self.own_listener().await?;
        listener.listen(KEY_FEED_CHANNEL).await.ok()?;
        // Ends at the first error (a lost connection): the table polls meanwhile and
        // listens again later.
        let signals = listener
            .into_stream()
            .take_while(|notification| std::future::ready(notification.is_ok()))
            .map(|_| ());
        Some(Box::pin(signals))
    }

    async fn record_usages(&self, rows: &[UsageRow]) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        // As the request log: one statement (atomic by itself, prepared once whatever
        // the batch's size), the columns as arrays. Every row checked first: all or none.
        let n = rows.len();
        let (mut key_id, mut request_id, mut month) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut prompt_tokens, mut completion_tokens, mut created_at) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for row in rows {
            let counts = UsageColumns::encode(row)?;
            key_id.push(row.key_id);
            request_id.push(row.request_id.as_str());
            month.push(row.month.as_str());
            prompt_tokens.push(counts.prompt_tokens);
            completion_tokens.push(counts.completion_tokens);
            created_at.push(row.created_at);
        }
        sqlx::query(concat!(
            "INSERT INTO usage_ledger ",
            "(key_id, request_id, month, prompt_tokens, completion_tokens, created_at) ",
            "SELECT * FROM UNNEST($1::BIGINT[], $2::TEXT[], $3::TEXT[], $4::BIGINT[], ",
            "$5::BIGINT[], $6::BIGINT[]) ",
            "ON CONFLICT (request_id) DO NOTHING"
        ))
        .bind(key_id)
        .bind(request_id)
        .bind(month)
        .bind(prompt_tokens)
        .bind(completion_tokens)
        .bind(created_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn append_request_log(&self, rows: &[RequestLogRow]) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        // One statement, one round trip: each column goes as an array and UNNEST turns
        // the arrays back into rows. A single statement is atomic on its own.
        let mut c = LogArrays::with_capacity(rows.len());
        for row in rows {
            c.push(row);
        }
        sqlx::query(concat!(
            "INSERT INTO request_log (",
            request_log_columns!(),
            ") SELECT * FROM UNNEST(",
            "$1::TEXT[], $2::BIGINT[], $3::BIGINT[], $4::TEXT[], $5::TEXT[], $6::TEXT[], ",
            "$7::TEXT[], $8::TEXT[], $9::BIGINT[], $10::BIGINT[], $11::INTEGER[], ",
            "$12::TEXT[], $13::BIGINT[], $14::TEXT[], $15::BIGINT[]) ",
            "ON CONFLICT (request_id) DO NOTHING"
        ))
        .bind(c.request_id)
        .bind(c.created_at_ms)
        .bind(c.key_id)
        .bind(c.key_prefix)
        .bind(c.email)
        .bind(c.client_ip)
        .bind(c.endpoint)
        .bind(c.model)
        .bind(c.prompt_tokens)
        .bind(c.completion_tokens)
        .bind(c.status)
        .bind(c.error_code)
        .bind(c.latency_ms)
        .bind(c.workload)
        .bind(c.queue_wait_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
});

/// `request_log` rows as one array per column, for `INSERT … SELECT * FROM UNNEST(…)`.
struct LogArrays<'a> {
    request_id: Vec<&'a str>,
    created_at_ms: Vec<i64>,
    key_id: Vec<Option<i64>>,
    key_prefix: Vec<Option<&'a str>>,
    email: Vec<Option<&'a str>>,
    client_ip: Vec<Option<String>>,
    endpoint: Vec<&'a str>,
    model: Vec<Option<&'a str>>,
    prompt_tokens: Vec<Option<i64>>,
    completion_tokens: Vec<Option<i64>>,
    status: Vec<i32>,
    error_code: Vec<Option<&'a str>>,
    latency_ms: Vec<i64>,
    workload: Vec<Option<&'a str>>,
    queue_wait_ms: Vec<Option<i64>>,
}

impl<'a> LogArrays<'a> {
    fn with_capacity(n: usize) -> Self {
        Self {
            request_id: Vec::with_capacity(n),
            created_at_ms: Vec::with_capacity(n),
            key_id: Vec::with_capacity(n),
            key_prefix: Vec::with_capacity(n),
            email: Vec::with_capacity(n),
            client_ip: Vec::with_capacity(n),
            endpoint: Vec::with_capacity(n),
            model: Vec::with_capacity(n),
            prompt_tokens: Vec::with_capacity(n),
            completion_tokens: Vec::with_capacity(n),
            status: Vec::with_capacity(n),
            error_code: Vec::with_capacity(n),
            latency_ms: Vec::with_capacity(n),
            workload: Vec::with_capacity(n),
            queue_wait_ms: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, row: &'a RequestLogRow) {
        let columns = LogColumns::encode(row);
        self.request_id.push(&row.request_id);
        self.created_at_ms.push(row.created_at_ms);
        self.key_id.push(row.key_id);
        self.key_prefix.push(row.key_prefix.as_deref());
        self.email.push(row.email.as_deref());
        self.client_ip.push(columns.client_ip);
        self.endpoint.push(&row.endpoint);
        self.model.push(row.model.as_deref());
        self.prompt_tokens.push(columns.prompt_tokens);
        self.completion_tokens.push(columns.completion_tokens);
        self.status.push(columns.status);
        self.error_code.push(row.error_code.as_deref());
        self.latency_ms.push(columns.latency_ms);
        self.workload.push(row.workload.as_deref());
        self.queue_wait_ms.push(columns.queue_wait_ms);
    }
}

impl_job_store!(
    PostgresStore,
    sqlx::Postgres,
    " FOR UPDATE SKIP LOCKED",
    "SELECT pg_notify('fleetgate_jobs', $1)" {
        async fn job_end_signals(&self) -> Option<super::jobs::JobEnds> {
            let mut listener = self.own_listener().await?;
            listener.listen(JOB_END_CHANNEL).await.ok()?;
            let ends = listener
                .into_stream()
                .take_while(|notification| std::future::ready(notification.is_ok()))
                .filter_map(|notification| {
                    std::future::ready(notification.ok().map(|n| n.payload().to_owned()))
                });
            Some(Box::pin(ends))
        }
    }
);
