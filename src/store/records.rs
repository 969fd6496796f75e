//! What the store holds (a key and its limit overrides, a ledger row, a request-log
//! row) and its errors; the [`Store`](super::Store) trait is in `backend.rs`.

use std::net::IpAddr;

/// One row of `api_keys`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: i64,
    pub name: String,
    pub email: Option<String>,
    /// The visible first 12 characters of the secret.
    pub prefix: String,
    /// SHA-256 of the secret (column `key_hash`); compare with [`crate::key_secret::verify`].
    pub hash: Vec<u8>,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds; `None` while the key is active.
    pub revoked_at: Option<i64>,
    /// The key's own limits; resolve them against the configured defaults with
    /// [`crate::admission::KeyLimits::resolve`].
    pub limits: LimitOverrides,
    /// Unix seconds from which the key is refused; `None`: never.
    pub expires_at: Option<i64>,
    /// SHA-256 of the secret the last rotation replaced (column `previous_key_hash`),
    /// accepted until `previous_expires_at`; `None` when there is none.
    pub previous_hash: Option<Vec<u8>>,
    /// Unix seconds from which the previous secret is refused.
    pub previous_expires_at: Option<i64>,
}

/// A key as the change feed gives it: its record and the number of its latest change.
/// Numbers grow in commit order, so a reader that has seen `seq` has seen every change
/// numbered below it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyChange {
    pub record: KeyRecord,
    pub seq: i64,
}

/// See [`Store::key_change_signals`].
pub type KeySignals = std::pin::Pin<Box<dyn futures_util::Stream<Item = ()> + Send>>;

/// A key's own limits; `None` means the configured default applies.
///
/// Stored values are bounded as [`crate::key_limits::Limit`] says: `requests_per_minute`,
/// `max_concurrent` and `share` at least 1, `share` at most 1000, the other `u32` limits
/// at most `i32::MAX` and the budget at most `i64::MAX` (PostgreSQL's
/// `INTEGER`/`BIGINT`); the store refuses others with [`StoreError::Invalid`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitOverrides {
    pub monthly_budget: Option<u64>,
    pub requests_per_minute: Option<u32>,
    pub max_concurrent: Option<u32>,
    pub max_queued: Option<u32>,
    pub share: Option<u32>,
}

/// A change to a key's limit overrides. For each limit: `None` leaves it as it is,
/// `Some(None)` returns it to the configured default, `Some(Some(v))` sets it to `v`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitUpdate {
    pub monthly_budget: Option<Option<u64>>,
    pub requests_per_minute: Option<Option<u32>>,
    pub max_concurrent: Option<Option<u32>>,
    pub max_queued: Option<Option<u32>>,
    pub share: Option<Option<u32>>,
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
    /// How long it waited for its turn (its key's queue, then its model's fleet
    /// queue); `None` when it never got that far. Stored up to `i64::MAX` (saturated).
    pub queue_wait_ms: Option<u64>,
}

impl KeyRecord {
    /// Whether the key is not revoked (it may have expired: see [`KeyRecord::is_usable`]).
    pub fn is_active(&self) -> bool {
        self.revoked_at.is_none()
    }

    /// Whether the key has expired at `now` (Unix seconds).
    pub fn is_expired(&self, now: i64) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }

    /// Whether requests may use this key at `now` (Unix seconds): neither revoked nor
    /// expired.
    pub fn is_usable(&self, now: i64) -> bool {
        self.is_active() && !self.is_expired(now)
    }

    /// When the previous secret stops working, if one still works at `now`.
    pub fn previous_secret_expires_at(&self, now: i64) -> Option<i64> {
        self.previous_expires_at
            .filter(|&at| at > now && self.previous_hash.is_some())
    }
}

/// Which request log rows to read; every filter is optional.
#[derive(Debug, Clone, Default)]
pub struct RequestQuery {
    pub key_id: Option<i64>,
    pub model: Option<String>,
    pub status: Option<StatusMatch>,
    /// From this time on, Unix milliseconds (inclusive).
    pub since_ms: Option<i64>,
    /// Before this time, Unix milliseconds (exclusive).
    pub until_ms: Option<i64>,
    /// At most this many rows (the newest).
    pub limit: u32,
}

/// A status filter: one status, or a class (`Class(4)`: 400–499).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMatch {
    Exact(u16),
    Class(u16),
}

impl StatusMatch {
    /// The statuses matched, as a half-open range.
    pub fn range(self) -> std::ops::Range<i64> {
        match self {
            Self::Exact(status) => i64::from(status)..i64::from(status) + 1,
            Self::Class(class) => i64::from(class) * 100..i64::from(class) * 100 + 100,
        }
    }
}

/// Which part of the request log to sum up.
#[derive(Debug, Clone, Default)]
pub struct SpendQuery {
    pub key_id: Option<i64>,
    /// From this time on, Unix milliseconds (inclusive).
    pub since_ms: Option<i64>,
    /// Before this time, Unix milliseconds (exclusive).
    pub until_ms: Option<i64>,
}

/// One UTC day's requests and tokens of one key on one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpendRow {
    /// Days since 1970-01-01 (UTC).
    pub day: i64,
    pub key_id: i64,
    pub key_prefix: Option<String>,
    /// `None` for requests refused before their model was known.
    pub model: Option<String>,
    pub requests: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
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
    /// The PostgreSQL database the URL names does not exist (the server's error, as
    /// sqlx wraps it, says so twice and not what to do).
    #[error(
        "database \"{0}\" does not exist; create it with `createdb {0}` (or `CREATE DATABASE {0};` in psql)"
    )]
    NoDatabase(String),
    /// The first connection to the database failed: why, in one line.
    #[error("{0}")]
    Connect(String),
    /// Opening the store at start-up failed; `url` has no password.
    #[error("cannot open the store at {url}")]
    Open {
        url: String,
        #[source]
        source: Box<StoreError>,
    },
    /// The store could not be reached when it was needed (its own error was logged
    /// where it happened).
    #[error("the store cannot be reached")]
    Unavailable,
    /// A key with this prefix already exists.
    #[error("a key with prefix {0} already exists")]
    Duplicate(String),
    /// A value the schema cannot hold (a limit out of range, a malformed month…); the
    /// message names the field, never a secret.
    #[error("invalid value: {0}")]
    Invalid(String),
    /// A write that would leave the key keeping `bytes`, over its bound of `limit`;
    /// nothing was written.
    #[error("the key would keep {bytes} bytes, over its bound of {limit}")]
    QuotaExceeded { bytes: i64, limit: i64 },
    #[error("cannot create the directory {}", .path.display())]
    CreateDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}
