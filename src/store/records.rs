//! What the store holds (a key and its limit overrides, a ledger row, a request-log
//! row), the [`Store`] trait both backends implement, and its errors.

use std::net::IpAddr;

pub use super::error::StoreError;
use super::workbench::WorkbenchStore;
use crate::keys::NewKey;

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

    /// `id_or_prefix`: a decimal id, or a key prefix. The key, revoked or not; None if no
    /// such key.
    async fn key(&self, id_or_prefix: &str) -> Result<Option<KeyRecord>, StoreError>;

    /// Every key (revoked ones included) created or changed after change number
    /// `since`, in change order; `since = 0`: all keys. What a server's key table reads
    /// at start and then polls; one range scan on an index.
    async fn keys_changed_since(&self, since: i64) -> Result<Vec<KeyChange>, StoreError>;

    /// A signal each time key changes are committed, for a backend that announces them
    /// (PostgreSQL: `NOTIFY fleetgate_keys` from the key feed trigger), so that a key
    /// table pulls at once rather than at its next poll; `None`: poll only (SQLite, or
    /// the database cannot be reached now). The stream ends when its connection is
    /// lost; a notification missed meanwhile is caught by the poll.
    async fn key_change_signals(&self) -> Option<KeySignals> {
        None
    }

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
    async fn record_usage(&self, row: &UsageRow) -> Result<(), StoreError> {
        self.record_usages(std::slice::from_ref(row)).await
    }

    /// Records finished requests' usage in one transaction: all rows or none (a bad
    /// row refuses the batch, as [`Store::record_usage`] says). Each row is idempotent
    /// on its `request_id`, so a batch retried after an unclear commit counts nothing
    /// twice.
    async fn record_usages(&self, rows: &[UsageRow]) -> Result<(), StoreError>;

    /// The key's recorded tokens (prompt + completion) for `month` (`YYYY-MM`); 0 when
    /// there are none. One indexed lookup.
    async fn month_usage(&self, key_id: i64, month: &str) -> Result<u64, StoreError>;

    /// Appends request metadata rows, all in one transaction (all or none). Rows whose
    /// `request_id` is already logged are skipped.
    async fn append_request_log(&self, rows: &[RequestLogRow]) -> Result<(), StoreError>;

    /// The latest `limit` request log rows, newest (`created_at_ms`) first.
    async fn recent_requests(&self, limit: u32) -> Result<Vec<RequestLogRow>, StoreError> {
        self.requests(&RequestQuery {
            limit,
            ..RequestQuery::default()
        })
        .await
    }

    /// The request log rows `query` selects, newest (`created_at_ms`) first.
    async fn requests(&self, query: &RequestQuery) -> Result<Vec<RequestLogRow>, StoreError>;

    /// Requests and tokens from the request log, per UTC day, key and model, oldest day
    /// first; only requests made with a key.
    async fn spend(&self, query: &SpendQuery) -> Result<Vec<SpendRow>, StoreError>;

    /// A round trip to the database, for health checks.
    async fn ping(&self) -> Result<(), StoreError>;

    /// The Workbench's and Loom's saved work, in the same database.
    fn workbench(&self) -> &dyn WorkbenchStore;
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
