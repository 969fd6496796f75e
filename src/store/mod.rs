//! Durable state behind one trait: SQLite (embedded default) and PostgreSQL.
//!
//! [`connect`] picks the backend from the URL and runs the migrations embedded from
//! `migrations/sqlite` or `migrations/postgres`. Both schemas keep the same tables,
//! columns and meanings; times are Unix seconds (UTC) in `BIGINT`/`INTEGER` columns
//! unless a column's name says otherwise (`created_at_ms`).
//!
//! Tables: `api_keys` (with each key's limit overrides), `usage_ledger` (the durable
//! truth of monthly budgets), `request_log` (request metadata, never prompt or
//! completion text; written in batches by [`crate::request_log::RequestLog`]) and `jobs`
//! (completion jobs, [`JobStore`]). The Workbench's and Loom's saved work
//! (`workbench_items`, `loom_trees`, `loom_nodes`) sits behind a trait of its own,
//! [`workbench::WorkbenchStore`], reached through [`Store::workbench`]. [`backup`] copies
//! a SQLite store while a server uses it (`fleetgate backup`).

use std::sync::Arc;

/// The columns of `api_keys`, as [`KeyRecord`]'s `FromRow` reads them, for
/// `SELECT`/`RETURNING`.
macro_rules! key_columns {
    () => {
        "id, name, email, prefix, key_hash, created_at, revoked_at, \
         monthly_budget_tokens, requests_per_minute, max_concurrent, max_queued, share, \
         expires_at, previous_key_hash, previous_expires_at"
    };
}

/// The columns of `request_log` but `id`, in [`RequestLogRow`] order, for `INSERT` and
/// `SELECT`.
macro_rules! request_log_columns {
    () => {
        "request_id, created_at_ms, key_id, key_prefix, email, client_ip, endpoint, model, \
         prompt_tokens, completion_tokens, status, error_code, latency_ms, workload, \
         queue_wait_ms"
    };
}

// `shared`, `job_sql` and `workbench_sql` first: their macros are used by the backends
// declared after them.
#[macro_use]
mod shared;
#[macro_use]
mod job_sql;
#[macro_use]
mod workbench_sql;
mod backend;
mod backup;
mod columns;
mod jobs;
mod migrations;
mod postgres;
mod records;
mod sqlite;
pub mod workbench;

pub use backend::Store;
pub use backup::{Backup, backup};
pub use columns::{now_unix, now_unix_ms};
pub use jobs::{
    Inserted, JobEnds, JobOutcome, JobQuery, JobRow, JobStatus, JobStore, NewJob, Pending,
    Retention, Swept,
};
pub use postgres::PostgresStore;
pub use records::{
    KeyChange, KeyRecord, KeySignals, LimitOverrides, LimitUpdate, RequestLogRow, RequestQuery,
    SpendQuery, SpendRow, StatusMatch, StoreError, UsageRow,
};
pub use sqlite::SqliteStore;

/// Opens the store for a URL: `sqlite://path/to/file.db` (create the file and its parent
/// directories if missing; WAL mode; busy timeout so the CLI and a running server can
/// share the file) or `sqlite::memory:`; `postgres://…`/`postgresql://…`. Runs the
/// migrations. Anything else: StoreError::UnsupportedUrl naming the URL scheme.
///
/// `sqlite://rel/path.db` is relative to the working directory, `sqlite:///abs/path.db`
/// absolute. Each `sqlite::memory:` store is a separate, private database that lives as
/// long as the store.
pub async fn connect(database_url: &str) -> Result<Arc<dyn Store>, StoreError> {
    let store: Result<Arc<dyn Store>, StoreError> = match url_scheme(database_url) {
        Some("sqlite") => SqliteStore::connect(database_url)
            .await
            .map(|s| Arc::new(s) as Arc<dyn Store>),
        Some("postgres" | "postgresql") => PostgresStore::connect(database_url)
            .await
            .map(|s| Arc::new(s) as Arc<dyn Store>),
        Some(other) => return Err(StoreError::UnsupportedUrl(other.to_owned())),
        None => return Err(StoreError::UnsupportedUrl(String::new())),
    };
    store.map_err(|source| StoreError::Open {
        url: redacted(database_url),
        source: Box::new(source),
    })
}

/// `url` with its passwords replaced by `***`: the user info's (up to the URL's last
/// `@`, since a password not percent-encoded may hold `/`, `?` or `#`) and the values of
/// `password` and `sslpassword` query parameters, which sqlx reads too. Fit for an
/// error message or a log.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let rest = match rest.rsplit_once('@') {
        Some((user_info, after)) => match user_info.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{after}"),
            None => rest.to_owned(),
        },
        None => rest.to_owned(),
    };
    let Some((before, query)) = rest.split_once('?') else {
        return format!("{scheme}://{rest}");
    };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if ["password", "sslpassword"].contains(&name) => {
                format!("{name}=***")
            }
            _ => pair.to_owned(),
        })
        .collect();
    format!("{scheme}://{before}?{}", query.join("&"))
}

/// The scheme of a URL (RFC 3986: a letter, then letters, digits, `+`, `-`, `.`), if it
/// has one. (Also the config's check of its store URLs.)
pub fn url_scheme(url: &str) -> Option<&str> {
    let (scheme, _) = url.split_once(':')?;
    let mut chars = scheme.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    (first_ok && rest_ok).then_some(scheme)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redacted_url_keeps_everything_but_the_password() {
        assert_eq!(
            redacted("postgres://fleetgate:s3cr3t@db:5432/fleetgate?sslmode=require"),
            "postgres://fleetgate:***@db:5432/fleetgate?sslmode=require"
        );
        assert_eq!(redacted("postgres://fg@db/x"), "postgres://fg@db/x");
        assert_eq!(
            redacted("postgres://fg:a/b?c#d@db/x"),
            "postgres://fg:***@db/x",
            "a password that is not percent-encoded"
        );
        assert_eq!(
            redacted("postgres://fg@db/x?sslmode=require&password=s3cr3t&sslpassword=k"),
            "postgres://fg@db/x?sslmode=require&password=***&sslpassword=***"
        );
        assert_eq!(
            redacted("sqlite://data/fleetgate.db"),
            "sqlite://data/fleetgate.db"
        );
        assert_eq!(redacted("sqlite::memory:"), "sqlite::memory:");
    }

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
}
