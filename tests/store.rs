//! The store, one suite for both backends.
//!
//! Each test is written once, as an async fn taking the store (or, for the tests that
//! need to reconnect, the database URL), and [`backend_tests!`] instantiates it for
//! SQLite (a fresh temp file per test) and for PostgreSQL (a fresh database per test,
//! dropped afterwards). The PostgreSQL tests are ignored by default; run them with
//! `TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test cargo test --test store -- --include-ignored`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fleetgate::keys::{self, NewKey};
use fleetgate::store::{self, KeyRecord, SqliteStore, Store, StoreError};
use sqlx::{AssertSqlSafe, Connection as _, PgConnection};

const POSTGRES_URL_VAR: &str = "TEST_POSTGRES_URL";

// ---------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------

/// A fresh, empty database for one test; removed when dropped (also when the test fails).
struct TestDb {
    url: String,
    _dir: Option<tempfile::TempDir>,
    _database: Option<PgDropGuard>,
}

impl TestDb {
    /// A SQLite file in a temp dir, under parent directories that do not exist yet.
    fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested").join("dirs").join("fleetgate.db");
        Self {
            url: format!("sqlite://{}", path.display()),
            _dir: Some(dir),
            _database: None,
        }
    }

    /// A new database `fg_test_<uuid>` on the server named by TEST_POSTGRES_URL.
    async fn postgres() -> Self {
        let admin_url = std::env::var(POSTGRES_URL_VAR).unwrap_or_else(|_| {
            panic!(
                "{POSTGRES_URL_VAR} is not set: the PostgreSQL tests need a server to create \
                 their databases on, e.g. {POSTGRES_URL_VAR}=postgres://postgres@127.0.0.1:5432/test"
            )
        });
        let name = format!("fg_test_{}", uuid::Uuid::new_v4().simple());
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
            _dir: None,
            _database: Some(PgDropGuard { admin_url, name }),
        }
    }

    async fn store(&self) -> Arc<dyn Store> {
        store::connect(&self.url).await.unwrap()
    }
}

/// Drops the test database. `Drop` cannot await and may run inside the test's runtime,
/// so it works on a thread of its own with its own runtime.
struct PgDropGuard {
    admin_url: String,
    name: String,
}

impl Drop for PgDropGuard {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        let outcome = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let mut admin = PgConnection::connect(&admin_url)
                    .await
                    .map_err(|e| e.to_string())?;
                sqlx::raw_sql(AssertSqlSafe(sql))
                    .execute(&mut admin)
                    .await
                    .map_err(|e| e.to_string())?;
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
fn with_database(url: &str, database: &str) -> String {
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

/// Instantiates each test for both backends: `store` tests get a connected store,
/// `url` tests the URL of a fresh database.
macro_rules! backend_tests {
    (store: [$($store_test:ident),* $(,)?], url: [$($url_test:ident),* $(,)?] $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $store_test() {
                    let db = super::TestDb::sqlite();
                    super::$store_test(db.store().await).await;
                }
            )*
            $(
                #[tokio::test]
                async fn $url_test() {
                    let db = super::TestDb::sqlite();
                    super::$url_test(&db.url).await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test]
                #[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
                async fn $store_test() {
                    let db = super::TestDb::postgres().await;
                    super::$store_test(db.store().await).await;
                }
            )*
            $(
                #[tokio::test]
                #[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
                async fn $url_test() {
                    let db = super::TestDb::postgres().await;
                    super::$url_test(&db.url).await;
                }
            )*
        }
    };
}

backend_tests! {
    store: [
        create_lookup_verify,
        generated_keys_are_unique_and_well_formed,
        list_keys,
        revoke_by_id,
        revoke_by_prefix,
        revoke_twice_keeps_first_time,
        revoke_unknown_is_none,
        duplicate_prefix_is_refused,
        ping,
    ],
    url: [
        migrations_are_idempotent,
        concurrent_first_connects,
    ],
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .try_into()
        .unwrap()
}

fn assert_recent(t: i64) {
    let now = now();
    assert!(
        (now - 5..=now + 1).contains(&t),
        "{t} is not about now ({now})"
    );
}

// ---------------------------------------------------------------------------------------
// Tests for both backends
// ---------------------------------------------------------------------------------------

async fn create_lookup_verify(store: Arc<dyn Store>) {
    let key = keys::generate();
    let created = store
        .create_key("alice", Some("alice@example.com"), &key)
        .await
        .unwrap();
    assert!(created.id > 0);
    assert_eq!(created.name, "alice");
    assert_eq!(created.email.as_deref(), Some("alice@example.com"));
    assert_eq!(created.prefix, key.prefix);
    assert_eq!(created.hash, key.hash);
    assert_recent(created.created_at);
    assert_eq!(created.revoked_at, None);
    assert!(created.is_active());

    // A key without an email.
    let other = keys::generate();
    let bob = store.create_key("bob", None, &other).await.unwrap();
    assert_eq!(bob.email, None);
    assert_ne!(bob.id, created.id);

    // The request path: parse the bearer, look up by prefix, verify the hash.
    let (prefix, presented) = keys::parse_bearer(key.secret.expose()).unwrap();
    let found = store.key_by_prefix(prefix).await.unwrap().unwrap();
    assert_eq!(found, created);
    assert!(keys::verify(&found.hash, &presented));
    assert!(!keys::verify(&found.hash, &other.hash));

    // A well-formed bearer whose prefix matches but whose body does not.
    let mut forged = key.secret.expose().to_owned();
    forged.replace_range(20..21, if &forged[20..21] == "A" { "B" } else { "A" });
    if let Some((prefix, hash)) = keys::parse_bearer(&forged) {
        let found = store.key_by_prefix(prefix).await.unwrap().unwrap();
        assert!(!keys::verify(&found.hash, &hash));
    }

    assert!(
        store
            .key_by_prefix(&keys::generate().prefix)
            .await
            .unwrap()
            .is_none()
    );
    assert!(store.key_by_prefix("").await.unwrap().is_none());
}

async fn generated_keys_are_unique_and_well_formed(store: Arc<dyn Store>) {
    let mut secrets = std::collections::HashSet::new();
    for i in 0..50 {
        let key = keys::generate();
        let secret = key.secret.expose();
        assert_eq!(secret.len(), 46, "{key:?}");
        assert!(secret.starts_with("fg-"));
        assert!(
            secret[3..]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
        assert_eq!(key.prefix, &secret[..12]);
        assert_eq!(key.hash, keys::hash_secret(secret));
        assert!(!format!("{key:?}").contains(secret));
        assert!(secrets.insert(secret.to_owned()));
        store
            .create_key(&format!("key {i}"), None, &key)
            .await
            .unwrap();
    }
    let listed = store.list_keys().await.unwrap();
    let prefixes: std::collections::HashSet<_> = listed.iter().map(|k| &k.prefix).collect();
    assert_eq!(prefixes.len(), 50);

    let good = keys::generate().secret.expose().to_owned();
    for junk in [
        "",
        "fg-",
        "Bearer fg-AAAA",
        "sk-proj-0123456789abcdef",
        &good[..45],
        &format!("{good}x"),
        &format!("sk-{}", &good[3..]),
        &format!("fg-{}", "*".repeat(43)),
        &format!("fg-{}+", &good[3..45]),
    ] {
        assert!(keys::parse_bearer(junk).is_none(), "accepted {junk:?}");
    }
}

async fn list_keys(store: Arc<dyn Store>) {
    assert!(store.list_keys().await.unwrap().is_empty());
    let mut created = Vec::new();
    for name in ["first", "second", "third"] {
        let key = keys::generate();
        created.push(store.create_key(name, None, &key).await.unwrap());
    }
    let revoked = store.revoke_key(&created[1].prefix).await.unwrap().unwrap();

    let listed = store.list_keys().await.unwrap();
    let names: Vec<_> = listed.iter().map(|k| k.name.as_str()).collect();
    assert_eq!(names, ["first", "second", "third"]);
    assert!(listed.windows(2).all(|w| w[0].id < w[1].id));
    assert_eq!(listed[0], created[0]);
    assert_eq!(listed[1], revoked);
    assert!(!listed[1].is_active());
    assert_eq!(listed[2], created[2]);
}

async fn revoke_by_id(store: Arc<dyn Store>) {
    let key = keys::generate();
    let other = keys::generate();
    let record = store.create_key("victim", None, &key).await.unwrap();
    let bystander = store.create_key("bystander", None, &other).await.unwrap();

    let revoked = store
        .revoke_key(&record.id.to_string())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(revoked.id, record.id);
    assert!(!revoked.is_active());
    assert_recent(revoked.revoked_at.unwrap());
    assert_eq!(
        KeyRecord {
            revoked_at: None,
            ..revoked.clone()
        },
        record
    );

    let found = store.key_by_prefix(&key.prefix).await.unwrap().unwrap();
    assert_eq!(found, revoked);
    assert!(!found.is_active());
    // The hash still verifies: the caller must check is_active too.
    assert!(keys::verify(&found.hash, &key.hash));

    let untouched = store.key_by_prefix(&other.prefix).await.unwrap().unwrap();
    assert_eq!(untouched, bystander);
    assert!(untouched.is_active());
}

async fn revoke_by_prefix(store: Arc<dyn Store>) {
    let key = keys::generate();
    let record = store.create_key("victim", None, &key).await.unwrap();
    let revoked = store.revoke_key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(revoked.id, record.id);
    assert!(!revoked.is_active());
    let found = store.key_by_prefix(&key.prefix).await.unwrap().unwrap();
    assert!(!found.is_active());
}

async fn revoke_twice_keeps_first_time(store: Arc<dyn Store>) {
    let key = keys::generate();
    let record = store.create_key("k", None, &key).await.unwrap();
    let first = store.revoke_key(&key.prefix).await.unwrap().unwrap();
    // Let the clock pass a whole second, so a second stamp would differ.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = store
        .revoke_key(&record.id.to_string())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.revoked_at, first.revoked_at);
    let found = store.key_by_prefix(&key.prefix).await.unwrap().unwrap();
    assert_eq!(found.revoked_at, first.revoked_at);
}

async fn revoke_unknown_is_none(store: Arc<dyn Store>) {
    let key = keys::generate();
    let record = store.create_key("k", None, &key).await.unwrap();
    for unknown in [
        (record.id + 1).to_string(),
        "0".to_owned(),
        "-1".to_owned(),
        "99999999999999999999999999".to_owned(),
        keys::generate().prefix,
        String::new(),
        "not a key".to_owned(),
    ] {
        assert_eq!(
            store.revoke_key(&unknown).await.unwrap(),
            None,
            "{unknown:?}"
        );
    }
    assert!(
        store
            .key_by_prefix(&key.prefix)
            .await
            .unwrap()
            .unwrap()
            .is_active()
    );
}

async fn duplicate_prefix_is_refused(store: Arc<dyn Store>) {
    let key = keys::generate();
    let record = store.create_key("original", None, &key).await.unwrap();

    // Another key that happens to share the prefix.
    let mut clash: NewKey = keys::generate();
    clash.prefix = key.prefix.clone();
    match store.create_key("clash", None, &clash).await {
        Err(StoreError::Duplicate(prefix)) => assert_eq!(prefix, key.prefix),
        other => panic!("expected Duplicate, got {other:?}"),
    }

    // The original is untouched and nothing else was stored.
    let listed = store.list_keys().await.unwrap();
    assert_eq!(listed, [record]);
    // The store still works after the failed insert.
    store
        .create_key("next", None, &keys::generate())
        .await
        .unwrap();
}

async fn ping(store: Arc<dyn Store>) {
    store.ping().await.unwrap();
}

async fn migrations_are_idempotent(url: &str) {
    let first = store::connect(url).await.unwrap();
    let key = keys::generate();
    let record = first.create_key("kept", None, &key).await.unwrap();

    // A second process (the CLI beside a running server) opening the same database.
    let second = store::connect(url).await.unwrap();
    assert_eq!(
        second.key_by_prefix(&key.prefix).await.unwrap(),
        Some(record.clone())
    );
    let revoked = second.revoke_key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(
        first.key_by_prefix(&key.prefix).await.unwrap(),
        Some(revoked)
    );
    drop(first);
    drop(second);

    // And a restart.
    let third = store::connect(url).await.unwrap();
    assert_eq!(third.list_keys().await.unwrap().len(), 1);
}

async fn concurrent_first_connects(url: &str) {
    // The server and the CLI (or two replicas) starting at once on a fresh database.
    let (a, b, c) = tokio::join!(
        store::connect(url),
        store::connect(url),
        store::connect(url)
    );
    let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
    let key = keys::generate();
    a.create_key("k", None, &key).await.unwrap();
    assert!(b.key_by_prefix(&key.prefix).await.unwrap().is_some());
    assert_eq!(c.list_keys().await.unwrap().len(), 1);
}

// ---------------------------------------------------------------------------------------
// SQLite only
// ---------------------------------------------------------------------------------------

fn sqlite_path(url: &str) -> PathBuf {
    PathBuf::from(url.strip_prefix("sqlite://").unwrap())
}

#[tokio::test]
async fn sqlite_creates_file_and_parent_dirs_in_wal_mode() {
    let db = TestDb::sqlite();
    let path = sqlite_path(&db.url);
    let parent = path.parent().unwrap();
    assert!(!parent.exists());

    let store = SqliteStore::connect(&db.url).await.unwrap();
    assert!(path.is_file());

    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    let timeout: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(timeout >= 1000, "busy_timeout {timeout} ms");
}

#[tokio::test]
async fn sqlite_relative_path() {
    // `sqlite://rel/path.db` is relative to the working directory.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let rel = relative_to(&std::env::current_dir().unwrap(), dir.path()).join("sub/fleetgate.db");
    assert!(rel.is_relative());
    let store = store::connect(&format!("sqlite://{}", rel.display()))
        .await
        .unwrap();
    store.ping().await.unwrap();
    assert!(dir.path().join("sub/fleetgate.db").is_file());
}

/// `to` as a path relative to `from` (both absolute).
fn relative_to(from: &std::path::Path, to: &std::path::Path) -> PathBuf {
    let from: Vec<_> = from.components().collect();
    let to: Vec<_> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in common..from.len() {
        rel.push("..");
    }
    for part in &to[common..] {
        rel.push(part);
    }
    rel
}

#[tokio::test]
async fn sqlite_never_stores_the_secret() {
    let db = TestDb::sqlite();
    let store = db.store().await;
    let key = keys::generate();
    store.create_key("k", None, &key).await.unwrap();
    store.ping().await.unwrap();

    let path = sqlite_path(&db.url);
    let mut bytes = Vec::new();
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        if let Ok(b) = std::fs::read(&file) {
            bytes.extend(b);
        }
    }
    let contains = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    assert!(
        contains(key.prefix.as_bytes()),
        "the prefix should be stored"
    );
    assert!(!contains(key.secret.expose().as_bytes()));
    assert!(!contains(&key.secret.expose().as_bytes()[..20]));
}

#[tokio::test]
async fn sqlite_memory() {
    let a = store::connect("sqlite::memory:").await.unwrap();
    let b = store::connect("sqlite::memory:").await.unwrap();
    let key = keys::generate();
    let record = a.create_key("k", None, &key).await.unwrap();
    // Kept across queries (one long-lived connection)...
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(a.key_by_prefix(&key.prefix).await.unwrap(), Some(record));
    // ...and private to its store.
    assert!(b.list_keys().await.unwrap().is_empty());
}

#[tokio::test]
async fn unsupported_urls_name_the_scheme() {
    for (url, scheme) in [
        ("mysql://user:hunter2@db/fleet", "mysql"),
        ("redis://localhost", "redis"),
        ("http://example.com", "http"),
    ] {
        match store::connect(url).await {
            Err(err @ StoreError::UnsupportedUrl(_)) => {
                let StoreError::UnsupportedUrl(named) = &err else {
                    unreachable!()
                };
                assert_eq!(named, scheme);
                let message = err.to_string();
                assert!(message.contains(scheme), "{message}");
                assert!(!message.contains("hunter2"), "{message}");
            }
            Err(other) => panic!("{url}: expected UnsupportedUrl, got {other:?}"),
            Ok(_) => panic!("{url}: expected UnsupportedUrl, got a store"),
        }
    }
    assert!(matches!(
        store::connect("data/fleetgate.db").await,
        Err(StoreError::UnsupportedUrl(_))
    ));
    assert!(matches!(
        store::connect("sqlite://").await,
        Err(StoreError::InvalidUrl(_))
    ));
}

#[test]
fn with_database_replaces_the_path() {
    assert_eq!(
        with_database("postgres://postgres@127.0.0.1:5432/test", "x"),
        "postgres://postgres@127.0.0.1:5432/x"
    );
    assert_eq!(
        with_database("postgres://u:p@h/test?sslmode=disable", "x"),
        "postgres://u:p@h/x?sslmode=disable"
    );
    assert_eq!(with_database("postgresql://h", "x"), "postgresql://h/x");
}
