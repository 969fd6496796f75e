//! The PostgreSQL backend.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgPoolOptions;

use super::{KeyRecord, KeySelector, Store, StoreError, insert_error, now_unix};
use crate::keys::NewKey;

static MIGRATOR: Migrator = sqlx::migrate!("migrations/postgres");

const POOL_SIZE: u32 = 10;
/// How long a query waits for a free connection before failing (so a health check on
/// an unreachable database answers instead of hanging).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// A store in a PostgreSQL database.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// Connects to a `postgres://` or `postgresql://` URL and migrates the database.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect(url)
            .await?;
        // Migrations take an advisory lock, so concurrent starts are safe.
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    /// The connection pool, for code that needs the database directly.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

#[async_trait::async_trait]
impl Store for PostgresStore {
    async fn create_key(
        &self,
        name: &str,
        email: Option<&str>,
        key: &NewKey,
    ) -> Result<KeyRecord, StoreError> {
        sqlx::query_as(concat!(
            "INSERT INTO api_keys (name, email, prefix, key_hash, created_at) ",
            "VALUES ($1, $2, $3, $4, $5) RETURNING ",
            key_columns!()
        ))
        .bind(name)
        .bind(email)
        .bind(&key.prefix)
        .bind(key.hash.as_slice())
        .bind(now_unix())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| insert_error(e, &key.prefix))
    }

    async fn key_by_prefix(&self, prefix: &str) -> Result<Option<KeyRecord>, StoreError> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys WHERE prefix = $1"
        ))
        .bind(prefix)
        .fetch_optional(&self.pool)
        .await?)
    }

    async fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys ORDER BY id"
        ))
        .fetch_all(&self.pool)
        .await?)
    }

    async fn revoke_key(&self, id_or_prefix: &str) -> Result<Option<KeyRecord>, StoreError> {
        let query = match KeySelector::parse(id_or_prefix) {
            KeySelector::Id(None) => return Ok(None),
            KeySelector::Id(Some(id)) => sqlx::query_as(concat!(
                "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $1) WHERE id = $2 RETURNING ",
                key_columns!()
            ))
            .bind(now_unix())
            .bind(id),
            KeySelector::Prefix(prefix) => sqlx::query_as(concat!(
                "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $1) WHERE prefix = $2 RETURNING ",
                key_columns!()
            ))
            .bind(now_unix())
            .bind(prefix),
        };
        Ok(query.fetch_optional(&self.pool).await?)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}
