//! A fresh PostgreSQL database per test, on the server named by `TEST_POSTGRES_URL`,
//! dropped when the test ends (also when it fails).

use sqlx::{AssertSqlSafe, Connection as _, PgConnection};

pub const POSTGRES_URL_VAR: &str = "TEST_POSTGRES_URL";

pub struct FreshDatabase {
    /// The new database's URL.
    pub url: String,
    /// The server's URL, for work on the database from outside.
    pub admin_url: String,
    pub name: String,
}

impl FreshDatabase {
    /// Creates `{prefix}_<uuid>`; fails the test, saying what to set, when
    /// `TEST_POSTGRES_URL` is not set.
    pub async fn create(prefix: &str) -> Self {
        let admin_url = std::env::var(POSTGRES_URL_VAR).unwrap_or_else(|_| {
            panic!(
                "{POSTGRES_URL_VAR} is not set: the PostgreSQL tests need a server to create \
                 their databases on, e.g. {POSTGRES_URL_VAR}=postgres://postgres@127.0.0.1:5432/test"
            )
        });
        let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(&admin_url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {POSTGRES_URL_VAR}: {e}"));
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        admin.close().await.unwrap();
        Self {
            url: with_database(&admin_url, &name),
            admin_url,
            name,
        }
    }
}

impl Drop for FreshDatabase {
    /// `Drop` cannot await and may run inside the test's runtime, so this works on a
    /// thread of its own with its own runtime.
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        // Under either name: a test may fail while the database is taken away.
        let names = [self.name.clone(), format!("{}_away", self.name)];
        let outcome = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let mut admin = PgConnection::connect(&admin_url)
                    .await
                    .map_err(|e| e.to_string())?;
                for name in names {
                    // One statement each: DROP DATABASE cannot run in a transaction.
                    sqlx::raw_sql(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut admin)
                    .await
                    .map_err(|e| e.to_string())?;
                }
                admin.close().await.map_err(|e| e.to_string())
            })
        })
        .join();
        // Never panic here: this may run while a failed test is already unwinding.
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("could not drop test database {}: {e}", self.name),
            Err(_) => eprintln!("could not drop test database {}: panicked", self.name),
        }
    }
}

/// `url` with its database (the path) replaced by `database`, query string kept.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    let mut out = format!("{}/{database}", &base[..path_start]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}
