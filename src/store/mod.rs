//! Durable state behind one trait: SQLite (embedded default) and PostgreSQL.
//!
//! [`connect`] picks the backend from the URL and runs the migrations embedded from
//! `migrations/sqlite` or `migrations/postgres`. Both schemas keep the same tables,
//! columns and meanings; times are Unix seconds (UTC) in `BIGINT`/`INTEGER` columns
//! unless a column's name says otherwise (`created_at_ms`).
//!
//! Tables: `api_keys` (with each key's limit overrides), `usage_ledger` (the durable
//! truth of monthly budgets) and `request_log` (request metadata, never prompt or
//! completion text; written in batches by [`crate::request_log::RequestLog`]).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::keys::Limit;
use crate::keys::NewKey;

/// The columns of `api_keys`, as [`KeyRecord`]'s `FromRow` reads them, for
/// `SELECT`/`RETURNING`.
macro_rules! key_columns {
    () => {
        "id, name, email, prefix, key_hash, created_at, revoked_at, \
         monthly_budget_tokens, requests_per_minute, max_concurrent, max_queued"
    };
}

/// The columns of `request_log` but `id`, in [`RequestLogRow`] order, for `INSERT` and
/// `SELECT`.
macro_rules! request_log_columns {
    () => {
        "request_id, created_at_ms, key_id, key_prefix, email, client_ip, endpoint, model, \
         prompt_tokens, completion_tokens, status, error_code, latency_ms, workload"
    };
}

#[macro_use]
mod shared;
mod postgres;
mod sqlite;

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

/// One row of `api_keys`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: i64,
    pub name: String,
    pub email: Option<String>,
    /// The visible first 12 characters of the secret.
    pub prefix: String,
    /// SHA-256 of the secret (column `key_hash`); compare with [`crate::keys::verify`].
    pub hash: Vec<u8>,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds; `None` while the key is active.
    pub revoked_at: Option<i64>,
    /// The key's own limits; resolve them against the configured defaults with
    /// [`crate::admission::KeyLimits::resolve`].
    pub limits: LimitOverrides,
}

/// A key's own limits; `None` means the configured default applies.
///
/// Stored values are bounded as [`crate::keys::Limit`] says: `requests_per_minute` and
/// `max_concurrent` at least 1, all three `u32` limits at most `i32::MAX` and the budget at
/// most `i64::MAX` (PostgreSQL's `INTEGER`/`BIGINT`); the store refuses others with
/// [`StoreError::Invalid`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitOverrides {
    pub monthly_budget: Option<u64>,
    pub requests_per_minute: Option<u32>,
    pub max_concurrent: Option<u32>,
    pub max_queued: Option<u32>,
}

/// A change to a key's limit overrides. For each limit: `None` leaves it as it is,
/// `Some(None)` returns it to the configured default, `Some(Some(v))` sets it to `v`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitUpdate {
    pub monthly_budget: Option<Option<u64>>,
    pub requests_per_minute: Option<Option<u32>>,
    pub max_concurrent: Option<Option<u32>>,
    pub max_queued: Option<Option<u32>>,
}

impl LimitUpdate {
    /// Whether the update changes nothing.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// One row of `usage_ledger`: the tokens one finished request used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageRow {
    pub key_id: i64,
    /// Recording is idempotent on this id: a second row with it is ignored.
    pub request_id: String,
    /// The budget month the usage counts against, `YYYY-MM` (UTC); see
    /// [`crate::admission::Month`].
    pub month: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Unix seconds.
    pub created_at: i64,
}

/// One row of `request_log`: a request's metadata. Never prompt or completion text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestLogRow {
    /// The gateway's request id (`X-Request-Id`). A second row with the same id is
    /// ignored.
    pub request_id: String,
    /// When the request arrived, Unix milliseconds.
    pub created_at_ms: i64,
    /// The authenticated key, if any.
    pub key_id: Option<i64>,
    pub key_prefix: Option<String>,
    pub email: Option<String>,
    pub client_ip: Option<IpAddr>,
    /// The route, e.g. `/v1/completions`.
    pub endpoint: String,
    pub model: Option<String>,
    /// Stored up to `i64::MAX` (larger counts are saturated).
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// The HTTP status sent.
    pub status: u16,
    /// The error envelope's `code`, for failed requests.
    pub error_code: Option<String>,
    /// Stored up to `i64::MAX` (saturated).
    pub latency_ms: u64,
    /// Where the request came from (API, Workbench, Loom…), if known.
    pub workload: Option<String>,
}

impl KeyRecord {
    /// Whether requests may still use this key.
    pub fn is_active(&self) -> bool {
        self.revoked_at.is_none()
    }
}

#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Stores a new key (its prefix and hash, never the secret) with its initial limit
    /// overrides. A key whose prefix is already taken is refused with
    /// [`StoreError::Duplicate`]; the caller may generate another. Out-of-range limits:
    /// [`StoreError::Invalid`].
    async fn create_key(
        &self,
        name: &str,
        email: Option<&str>,
        key: &NewKey,
        limits: &LimitOverrides,
    ) -> Result<KeyRecord, StoreError>;

    /// The key with this prefix, revoked or not. The per-request path: one lookup on the
    /// unique index.
    async fn key_by_prefix(&self, prefix: &str) -> Result<Option<KeyRecord>, StoreError>;

    /// `id_or_prefix`: a decimal id, or a key prefix. The key, revoked or not; None if no
    /// such key.
    async fn key(&self, id_or_prefix: &str) -> Result<Option<KeyRecord>, StoreError>;

    /// All keys, revoked ones included, oldest first.
    async fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError>;

    /// `id_or_prefix`: a decimal id, or a key prefix. Returns the revoked record, None if
    /// no such key. Revoking twice keeps the first revoked_at.
    async fn revoke_key(&self, id_or_prefix: &str) -> Result<Option<KeyRecord>, StoreError>;

    /// Changes a key's limit overrides (revoked keys too) in one statement and returns
    /// the updated record; None if no such key. Out-of-range limits:
    /// [`StoreError::Invalid`], and nothing changes.
    async fn set_limits(
        &self,
        id_or_prefix: &str,
        update: &LimitUpdate,
    ) -> Result<Option<KeyRecord>, StoreError>;

    /// Records a finished request's usage. Idempotent on `request_id`: recording the same
    /// request again (a retry) changes nothing, whatever its counts. A month that is not
    /// `YYYY-MM` or counts above `i64::MAX`: [`StoreError::Invalid`]; an unknown key: a
    /// database error (foreign key).
    async fn record_usage(&self, row: &UsageRow) -> Result<(), StoreError>;

    /// The key's recorded tokens (prompt + completion) for `month` (`YYYY-MM`); 0 when
    /// there are none. One indexed lookup.
    async fn month_usage(&self, key_id: i64, month: &str) -> Result<u64, StoreError>;

    /// Appends request metadata rows, all in one transaction (all or none). Rows whose
    /// `request_id` is already logged are skipped.
    async fn append_request_log(&self, rows: &[RequestLogRow]) -> Result<(), StoreError>;

    /// The latest `limit` request log rows, newest (`created_at_ms`) first.
    async fn recent_requests(&self, limit: u32) -> Result<Vec<RequestLogRow>, StoreError>;

    /// A round trip to the database, for health checks.
    async fn ping(&self) -> Result<(), StoreError>;
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
    #[error("database migration failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The URL's scheme (never the whole URL, which may hold a password).
    #[error(
        "unsupported database URL scheme {0:?}: use sqlite://PATH, sqlite::memory:, postgres://… or postgresql://…"
    )]
    UnsupportedUrl(String),
    #[error("invalid database URL: {0}")]
    InvalidUrl(String),
    /// A key with this prefix already exists.
    #[error("a key with prefix {0} already exists")]
    Duplicate(String),
    /// A value the schema cannot hold (a limit out of range, a malformed month…); the
    /// message names the field, never a secret.
    #[error("invalid value: {0}")]
    Invalid(String),
    #[error("cannot create the directory {}", .path.display())]
    CreateDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Opens the store for a URL: `sqlite://path/to/file.db` (create the file and its parent
/// directories if missing; WAL mode; busy timeout so the CLI and a running server can
/// share the file) or `sqlite::memory:`; `postgres://…`/`postgresql://…`. Runs the
/// migrations. Anything else: StoreError::UnsupportedUrl naming the URL scheme.
///
/// `sqlite://rel/path.db` is relative to the working directory, `sqlite:///abs/path.db`
/// absolute. Each `sqlite::memory:` store is a separate, private database that lives as
/// long as the store.
pub async fn connect(database_url: &str) -> Result<Arc<dyn Store>, StoreError> {
    match url_scheme(database_url) {
        Some("sqlite") => Ok(Arc::new(SqliteStore::connect(database_url).await?)),
        Some("postgres" | "postgresql") => {
            Ok(Arc::new(PostgresStore::connect(database_url).await?))
        }
        Some(other) => Err(StoreError::UnsupportedUrl(other.to_owned())),
        None => Err(StoreError::UnsupportedUrl(String::new())),
    }
}

/// The scheme of a URL (RFC 3986: a letter, then letters, digits, `+`, `-`, `.`), if it
/// has one.
fn url_scheme(url: &str) -> Option<&str> {
    let (scheme, _) = url.split_once(':')?;
    let mut chars = scheme.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    (first_ok && rest_ok).then_some(scheme)
}

/// How `key`, `revoke_key` and `set_limits` read `id_or_prefix`: all ASCII digits is an id (prefixes start with
/// `fg-`, so the two never overlap); `Id(None)` is an id too large to exist. Anything else
/// is looked up as a prefix.
enum KeySelector<'a> {
    Id(Option<i64>),
    Prefix(&'a str),
}

impl<'a> KeySelector<'a> {
    fn parse(id_or_prefix: &'a str) -> Self {
        if !id_or_prefix.is_empty() && id_or_prefix.bytes().all(|b| b.is_ascii_digit()) {
            Self::Id(id_or_prefix.parse().ok())
        } else {
            Self::Prefix(id_or_prefix)
        }
    }
}

impl<'a> KeySelector<'a> {
    /// The `(id, prefix)` pair to bind to `WHERE id = ? OR prefix = ?` (the other one
    /// NULL, which matches nothing); None when no key can match.
    fn binds(&self) -> Option<(Option<i64>, Option<&'a str>)> {
        match *self {
            Self::Id(None) => None,
            Self::Id(Some(id)) => Some((Some(id), None)),
            Self::Prefix(prefix) => Some((None, Some(prefix))),
        }
    }
}

/// Limit overrides as stored: `NULL` or a value the column can hold.
struct LimitColumns {
    monthly_budget: Option<i64>,
    requests_per_minute: Option<i32>,
    max_concurrent: Option<i32>,
    max_queued: Option<i32>,
}

impl LimitColumns {
    fn encode(limits: &LimitOverrides) -> Result<Self, StoreError> {
        Ok(Self {
            monthly_budget: limits.monthly_budget.map(budget_column).transpose()?,
            requests_per_minute: limits
                .requests_per_minute
                .map(|v| limit_column(Limit::RequestsPerMinute, v))
                .transpose()?,
            max_concurrent: limits
                .max_concurrent
                .map(|v| limit_column(Limit::MaxConcurrent, v))
                .transpose()?,
            max_queued: limits
                .max_queued
                .map(|v| limit_column(Limit::MaxQueued, v))
                .transpose()?,
        })
    }
}

/// A [`LimitUpdate`] as bound to `SET col = CASE WHEN <change> THEN <value> ELSE col END`:
/// for each limit, whether to change it and the new value (`NULL`: the default).
struct UpdateColumns {
    monthly_budget: (bool, Option<i64>),
    requests_per_minute: (bool, Option<i32>),
    max_concurrent: (bool, Option<i32>),
    max_queued: (bool, Option<i32>),
}

impl UpdateColumns {
    fn encode(update: &LimitUpdate) -> Result<Self, StoreError> {
        fn change<T, C>(
            value: Option<Option<T>>,
            encode: impl FnOnce(T) -> Result<C, StoreError>,
        ) -> Result<(bool, Option<C>), StoreError> {
            Ok(match value {
                None => (false, None),
                Some(None) => (true, None),
                Some(Some(v)) => (true, Some(encode(v)?)),
            })
        }
        Ok(Self {
            monthly_budget: change(update.monthly_budget, budget_column)?,
            requests_per_minute: change(update.requests_per_minute, |v| {
                limit_column(Limit::RequestsPerMinute, v)
            })?,
            max_concurrent: change(update.max_concurrent, |v| {
                limit_column(Limit::MaxConcurrent, v)
            })?,
            max_queued: change(update.max_queued, |v| limit_column(Limit::MaxQueued, v))?,
        })
    }
}

fn budget_column(tokens: u64) -> Result<i64, StoreError> {
    Limit::MonthlyBudget
        .check(tokens)
        .map_err(|err| StoreError::Invalid(err.to_string()))
}

/// A `u32` limit as its `INTEGER` column holds it, within the limit's bounds.
fn limit_column(limit: Limit, value: u32) -> Result<i32, StoreError> {
    limit
        .check(value)
        .map_err(|err| StoreError::Invalid(err.to_string()))
}

/// A [`UsageRow`]'s counts as stored, after checking the month.
struct UsageColumns {
    prompt_tokens: i64,
    completion_tokens: i64,
}

impl UsageColumns {
    fn encode(row: &UsageRow) -> Result<Self, StoreError> {
        if !is_month(&row.month) {
            return Err(StoreError::Invalid(format!(
                "usage month must be YYYY-MM (got {:?})",
                row.month
            )));
        }
        let tokens = |name: &str, n: u64| {
            i64::try_from(n).map_err(|_| {
                StoreError::Invalid(format!("{name} must be at most {} (got {n})", i64::MAX))
            })
        };
        Ok(Self {
            prompt_tokens: tokens("prompt_tokens", row.prompt_tokens)?,
            completion_tokens: tokens("completion_tokens", row.completion_tokens)?,
        })
    }
}

/// Whether `month` is `YYYY-MM` with a month 01–12 (what the schema's CHECK accepts).
fn is_month(month: &str) -> bool {
    let b = month.as_bytes();
    b.len() == 7
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[5..].iter().all(u8::is_ascii_digit)
        && (b"01".as_slice()..=b"12".as_slice()).contains(&&b[5..])
}

/// A [`RequestLogRow`]'s non-text columns as stored. Never fails: counts beyond the
/// column saturate, so one odd row cannot make a whole batch fail.
struct LogColumns {
    client_ip: Option<String>,
    prompt_tokens: Option<i64>,
    completion_tokens: Option<i64>,
    status: i32,
    latency_ms: i64,
}

impl LogColumns {
    fn encode(row: &RequestLogRow) -> Self {
        let saturate = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        Self {
            client_ip: row.client_ip.map(|ip| ip.to_string()),
            prompt_tokens: row.prompt_tokens.map(saturate),
            completion_tokens: row.completion_tokens.map(saturate),
            status: i32::from(row.status),
            latency_ms: saturate(row.latency_ms),
        }
    }
}

/// Reads a stored value into the Rust type the column means, or a decode error naming
/// the column.
fn convert<S, T>(value: S, column: &str) -> Result<T, sqlx::Error>
where
    T: TryFrom<S>,
    S: Copy + std::fmt::Display,
{
    T::try_from(value).map_err(|_| sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: format!("{value} is out of range").into(),
    })
}

fn convert_opt<S, T>(value: Option<S>, column: &str) -> Result<Option<T>, sqlx::Error>
where
    T: TryFrom<S>,
    S: Copy + std::fmt::Display,
{
    value.map(|v| convert(v, column)).transpose()
}

/// Rows of both backends (SQLite and PostgreSQL) decode the same way: the limit columns
/// as `INTEGER` (i32) and `BIGINT` (i64).
impl<'r, R> sqlx::FromRow<'r, R> for KeyRecord
where
    R: sqlx::Row,
    &'r str: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        let limit = |column: &'r str| -> Result<Option<u32>, sqlx::Error> {
            convert_opt(row.try_get::<Option<i32>, _>(column)?, column)
        };
        Ok(Self {
            id: row.try_get("id")?,
            name: row.try_get("name")?,
            email: row.try_get("email")?,
            prefix: row.try_get("prefix")?,
            hash: row.try_get("key_hash")?,
            created_at: row.try_get("created_at")?,
            revoked_at: row.try_get("revoked_at")?,
            limits: LimitOverrides {
                monthly_budget: convert_opt(
                    row.try_get::<Option<i64>, _>("monthly_budget_tokens")?,
                    "monthly_budget_tokens",
                )?,
                requests_per_minute: limit("requests_per_minute")?,
                max_concurrent: limit("max_concurrent")?,
                max_queued: limit("max_queued")?,
            },
        })
    }
}

impl<'r, R> sqlx::FromRow<'r, R> for RequestLogRow
where
    R: sqlx::Row,
    &'r str: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        let tokens = |column: &'r str| -> Result<Option<u64>, sqlx::Error> {
            convert_opt(row.try_get::<Option<i64>, _>(column)?, column)
        };
        let client_ip = row
            .try_get::<Option<String>, _>("client_ip")?
            .map(|ip| {
                ip.parse()
                    .map_err(|e: std::net::AddrParseError| sqlx::Error::ColumnDecode {
                        index: "client_ip".to_owned(),
                        source: e.into(),
                    })
            })
            .transpose()?;
        Ok(Self {
            request_id: row.try_get("request_id")?,
            created_at_ms: row.try_get("created_at_ms")?,
            key_id: row.try_get("key_id")?,
            key_prefix: row.try_get("key_prefix")?,
            email: row.try_get("email")?,
            client_ip,
            endpoint: row.try_get("endpoint")?,
            model: row.try_get("model")?,
            prompt_tokens: tokens("prompt_tokens")?,
            completion_tokens: tokens("completion_tokens")?,
            status: convert(row.try_get::<i32, _>("status")?, "status")?,
            error_code: row.try_get("error_code")?,
            latency_ms: convert(row.try_get::<i64, _>("latency_ms")?, "latency_ms")?,
            workload: row.try_get("workload")?,
        })
    }
}

/// Maps a failed insert of `prefix` to [`StoreError::Duplicate`] when a unique
/// constraint refused it.
fn insert_error(err: sqlx::Error, prefix: &str) -> StoreError {
    match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => {
            StoreError::Duplicate(prefix.to_owned())
        }
        _ => StoreError::Database(err),
    }
}

/// Now, in Unix seconds.
fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes() {
        assert_eq!(url_scheme("sqlite::memory:"), Some("sqlite"));
        assert_eq!(url_scheme("sqlite://a/b.db"), Some("sqlite"));
        assert_eq!(url_scheme("postgresql://u@h/db"), Some("postgresql"));
        assert_eq!(url_scheme("mysql://u:p@h/db"), Some("mysql"));
        assert_eq!(url_scheme("data/fleetgate.db"), None);
        assert_eq!(url_scheme("/abs/x:y"), None);
        assert_eq!(url_scheme(":memory:"), None);
    }

    #[test]
    fn months() {
        for good in ["2026-01", "2026-12", "0000-09", "9999-10"] {
            assert!(is_month(good), "{good}");
        }
        for bad in [
            "2026-00",
            "2026-13",
            "2026-1",
            "2026-001",
            "202-01",
            "2026/01",
            "2026-0a",
            "",
            "２026-01",
        ] {
            assert!(!is_month(bad), "{bad}");
        }
    }

    #[test]
    fn limit_bounds() {
        assert_eq!(limit_column(Limit::RequestsPerMinute, 1).ok(), Some(1));
        assert!(limit_column(Limit::RequestsPerMinute, 0).is_err());
        assert!(limit_column(Limit::MaxConcurrent, 0).is_err());
        assert_eq!(limit_column(Limit::MaxQueued, 0).ok(), Some(0));
        assert_eq!(
            limit_column(Limit::MaxQueued, i32::MAX as u32).ok(),
            Some(i32::MAX)
        );
        match limit_column(Limit::MaxQueued, 3_000_000_000) {
            Err(StoreError::Invalid(message)) => assert_eq!(
                message,
                "max_queued must be between 0 and 2147483647 (got 3000000000)"
            ),
            other => panic!("expected Invalid, got {other:?}"),
        }
        assert_eq!(budget_column(i64::MAX as u64).ok(), Some(i64::MAX));
        assert!(budget_column(u64::MAX).is_err());
    }

    #[test]
    fn selectors() {
        assert!(matches!(
            KeySelector::parse("42"),
            KeySelector::Id(Some(42))
        ));
        assert!(matches!(
            KeySelector::parse("99999999999999999999999"),
            KeySelector::Id(None)
        ));
        assert!(matches!(
            KeySelector::parse("fg-AbCdEfGhI"),
            KeySelector::Prefix("fg-AbCdEfGhI")
        ));
        assert!(matches!(
            KeySelector::parse("-1"),
            KeySelector::Prefix("-1")
        ));
        assert!(matches!(KeySelector::parse(""), KeySelector::Prefix("")));
    }
}
