//! The [`Store`] trait both backends (SQLite, PostgreSQL) implement: keys, the usage
//! ledger, the request log, and the way to their completion jobs and to the Workbench's
//! and Loom's saved work.

use super::jobs::JobStore;
use super::records::{
    KeyChange, KeyRecord, KeySignals, LimitOverrides, LimitUpdate, RequestLogRow, RequestQuery,
    SpendQuery, SpendRow, StoreError, UsageRow,
};
use super::workbench::WorkbenchStore;
use crate::key_secret::NewKey;

#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Stores a new key (its prefix and hash, never the secret) with its initial limit
    /// overrides and no expiry. A key whose prefix is already taken is refused with
    /// [`StoreError::Duplicate`]; the caller may generate another. Out-of-range limits:
    /// [`StoreError::Invalid`].
    async fn create_key(
        &self,
        name: &str,
        email: Option<&str>,
        key: &NewKey,
        limits: &LimitOverrides,
    ) -> Result<KeyRecord, StoreError> {
        self.create_expiring_key(name, email, key, limits, None)
            .await
    }

    /// As [`Store::create_key`], with the Unix second from which the key is refused
    /// (`None`: never).
    async fn create_expiring_key(
        &self,
        name: &str,
        email: Option<&str>,
        key: &NewKey,
        limits: &LimitOverrides,
        expires_at: Option<i64>,
    ) -> Result<KeyRecord, StoreError>;

    /// Gives a key a new secret hash (same id, prefix, limits and everything else) in one
    /// statement and returns the updated record; None if no such key. The hash it
    /// replaces becomes the previous one, accepted until `previous_until` (Unix
    /// seconds); `None`: not at all (the previous hash is cleared). A previous hash
    /// kept from an earlier rotation is replaced either way.
    async fn rotate_key(
        &self,
        id_or_prefix: &str,
        hash: &[u8; 32],
        previous_until: Option<i64>,
    ) -> Result<Option<KeyRecord>, StoreError>;

    /// Sets (`Some`) or clears (`None`) the Unix second from which a key is refused, and
    /// returns the updated record; None if no such key.
    async fn set_expiry(
        &self,
        id_or_prefix: &str,
        expires_at: Option<i64>,
    ) -> Result<Option<KeyRecord>, StoreError>;

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

    /// Deletes at most `limit` request log rows logged before `before_ms` (Unix ms), the
    /// oldest first; returns how many. One short statement: a sweep calls it in a loop
    /// (`background::request_log_retention`).
    async fn delete_requests_before(&self, before_ms: i64, limit: u32) -> Result<u64, StoreError>;

    /// The request log rows `query` selects, newest (`created_at_ms`) first.
    async fn requests(&self, query: &RequestQuery) -> Result<Vec<RequestLogRow>, StoreError>;

    /// Requests and tokens from the request log, per UTC day, key and model, oldest day
    /// first; only requests made with a key.
    async fn spend(&self, query: &SpendQuery) -> Result<Vec<SpendRow>, StoreError>;

    /// A round trip to the database, for health checks.
    async fn ping(&self) -> Result<(), StoreError>;

    /// The completion jobs kept in the same database.
    fn jobs(&self) -> &dyn JobStore;

    /// The Workbench's and Loom's saved work, in the same database.
    fn workbench(&self) -> &dyn WorkbenchStore;
}
