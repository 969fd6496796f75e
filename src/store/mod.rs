//! Durable state behind one trait: SQLite (embedded default) and PostgreSQL.
//!
//! [`connect`] picks the backend from the URL and runs the migrations embedded from
//! `migrations/sqlite` or `migrations/postgres`. Both schemas keep the same tables,
//! columns and meanings; times are Unix seconds (UTC) in `BIGINT`/`INTEGER` columns.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::keys::NewKey;

/// The columns of `api_keys`, in [`KeyRecord`] order, for `SELECT`/`RETURNING`.
macro_rules! key_columns {
    () => {
        "id, name, email, prefix, key_hash, created_at, revoked_at"
    };
}

mod postgres;
mod sqlite;

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

/// One row of `api_keys`.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct KeyRecord {
    pub id: i64,
    pub name: String,
    pub email: Option<String>,
    /// The visible first 12 characters of the secret.
    pub prefix: String,
    /// SHA-256 of the secret; compare with [`crate::keys::verify`].
    #[sqlx(rename = "key_hash")]
    pub hash: Vec<u8>,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds; `None` while the key is active.
    pub revoked_at: Option<i64>,
}

/// A key's own limits; `None` means the configured default applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitOverrides {
    pub monthly_budget: Option<u64>,
    pub requests_per_minute: Option<u32>,
    pub max_concurrent: Option<u32>,
    pub max_queued: Option<u32>,
}

impl KeyRecord {
    /// Whether requests may still use this key.
    pub fn is_active(&self) -> bool {
        self.revoked_at.is_none()
    }
}

#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Stores a new key (its prefix and hash, never the secret). A key whose prefix is
    /// already taken is refused with [`StoreError::Duplicate`]; the caller may generate
    /// another.
    async fn create_key(
        &self,
        name: &str,
        email: Option<&str>,
        key: &NewKey,
    ) -> Result<KeyRecord, StoreError>;

    /// The key with this prefix, revoked or not. The per-request path: one lookup on the
    /// unique index.
    async fn key_by_prefix(&self, prefix: &str) -> Result<Option<KeyRecord>, StoreError>;

    /// All keys, revoked ones included, oldest first.
    async fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError>;

    /// `id_or_prefix`: a decimal id, or a key prefix. Returns the revoked record, None if
    /// no such key. Revoking twice keeps the first revoked_at.
    async fn revoke_key(&self, id_or_prefix: &str) -> Result<Option<KeyRecord>, StoreError>;

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

/// How `revoke_key` reads `id_or_prefix`: all ASCII digits is an id (prefixes start with
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
