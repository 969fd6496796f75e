//! The store, one suite for both backends.
//!
//! Each test is written once, as an async fn taking the store (or, for the tests that
//! need to reconnect, the database URL), and [`backend_tests!`] instantiates it for
//! SQLite (a fresh temp file per test) and for PostgreSQL (a fresh database per test,
//! dropped afterwards). The PostgreSQL tests are ignored by default; run them with
//! `TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test cargo test --test it store:: -- --include-ignored`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::postgres::{FreshDatabase, with_database};
use fleetgate::key_secret::{self, NewKey};
use fleetgate::request_log::{RequestLog, RequestLogConfig, RequestLogStats};
use fleetgate::store::{
    self, KeyChange, KeyRecord, LimitOverrides, LimitUpdate, RequestLogRow, RequestQuery,
    SpendQuery, SpendRow, SqliteStore, StatusMatch, Store, StoreError, UsageRow,
};

/// No overrides: every limit is the configured default.
const DEFAULTS: &LimitOverrides = &LimitOverrides {
    monthly_budget: None,
    requests_per_minute: None,
    max_concurrent: None,
    max_queued: None,
    share: None,
};

// ---------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------

/// A fresh, empty database for one test; removed when dropped (also when the test fails).
pub(crate) struct TestDb {
    url: String,
    _dir: Option<tempfile::TempDir>,
    _database: Option<FreshDatabase>,
}

impl TestDb {
    /// A SQLite file in a temp dir, under parent directories that do not exist yet.
    pub(crate) fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested").join("dirs").join("fleetgate.db");
        Self {
            url: format!("sqlite://{}", path.display()),
            _dir: Some(dir),
            _database: None,
        }
    }

    /// A new database `fg_test_<uuid>` on the server named by TEST_POSTGRES_URL.
    pub(crate) async fn postgres() -> Self {
        let database = FreshDatabase::create("fg_test").await;
        Self {
            url: database.url.clone(),
            _dir: None,
            _database: Some(database),
        }
    }

    pub(crate) async fn store(&self) -> Arc<dyn Store> {
        store::connect(&self.url).await.unwrap()
    }
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
        key_feed_numbers_every_change_in_order,
        rotation_and_expiry_are_key_changes,
        create_with_limits,
        set_and_clear_limits,
        invalid_limits_are_refused,
        key_by_id_or_prefix,
        text_with_nul_is_invalid_or_matches_no_key,
        usage_sums_by_key_and_month,
        usage_is_idempotent,
        usage_refuses_bad_rows,
        usage_batches_are_all_or_none,
        request_log_round_trip,
        request_log_filters_and_spend_by_day,
        request_log_writer_close_writes_everything,
        request_log_writer_flush,
    ],
    url: [
        migrations_are_idempotent,
        concurrent_first_connects,
        existing_keys_get_default_limits,
        the_schema_holds_share_to_its_bounds,
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
    let key = key_secret::generate();
    let created = store
        .create_key("alice", Some("alice@example.com"), &key, DEFAULTS)
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
    let other = key_secret::generate();
    let bob = store
        .create_key("bob", None, &other, DEFAULTS)
        .await
        .unwrap();
    assert_eq!(bob.email, None);
    assert_ne!(bob.id, created.id);

    // What authentication does: parse the bearer, look the prefix up, verify the hash.
    let (prefix, presented) = key_secret::parse_bearer(key.secret.expose()).unwrap();
    let found = store.key(prefix).await.unwrap().unwrap();
    assert_eq!(found, created);
    assert!(key_secret::verify(&found.hash, &presented));
    assert!(!key_secret::verify(&found.hash, &other.hash));

    // A well-formed bearer whose prefix matches but whose body does not.
    let mut forged = key.secret.expose().to_owned();
    forged.replace_range(20..21, if &forged[20..21] == "A" { "B" } else { "A" });
    if let Some((prefix, hash)) = key_secret::parse_bearer(&forged) {
        let found = store.key(prefix).await.unwrap().unwrap();
        assert!(!key_secret::verify(&found.hash, &hash));
    }

    assert!(
        store
            .key(&key_secret::generate().prefix)
            .await
            .unwrap()
            .is_none()
    );
    assert!(store.key("").await.unwrap().is_none());
}

async fn generated_keys_are_unique_and_well_formed(store: Arc<dyn Store>) {
    let mut secrets = std::collections::HashSet::new();
    for i in 0..50 {
        let key = key_secret::generate();
        let secret = key.secret.expose();
        assert_eq!(secret.len(), 46, "{key:?}");
        assert!(secret.starts_with("fg-"));
        assert!(
            secret[3..]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
        assert_eq!(key.prefix, &secret[..12]);
        assert_eq!(key.hash, key_secret::hash_secret(secret));
        assert!(!format!("{key:?}").contains(secret));
        assert!(secrets.insert(secret.to_owned()));
        store
            .create_key(&format!("key {i}"), None, &key, DEFAULTS)
            .await
            .unwrap();
    }
    let listed = store.list_keys().await.unwrap();
    let prefixes: std::collections::HashSet<_> = listed.iter().map(|k| &k.prefix).collect();
    assert_eq!(prefixes.len(), 50);

    let good = key_secret::generate().secret.expose().to_owned();
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
        assert!(
            key_secret::parse_bearer(junk).is_none(),
            "accepted {junk:?}"
        );
    }
}

async fn list_keys(store: Arc<dyn Store>) {
    assert!(store.list_keys().await.unwrap().is_empty());
    let mut created = Vec::new();
    for name in ["first", "second", "third"] {
        let key = key_secret::generate();
        created.push(store.create_key(name, None, &key, DEFAULTS).await.unwrap());
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
    let key = key_secret::generate();
    let other = key_secret::generate();
    let record = store
        .create_key("victim", None, &key, DEFAULTS)
        .await
        .unwrap();
    let bystander = store
        .create_key("bystander", None, &other, DEFAULTS)
        .await
        .unwrap();

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

    let found = store.key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(found, revoked);
    assert!(!found.is_active());
    // The hash still verifies: the caller must check is_active too.
    assert!(key_secret::verify(&found.hash, &key.hash));

    let untouched = store.key(&other.prefix).await.unwrap().unwrap();
    assert_eq!(untouched, bystander);
    assert!(untouched.is_active());
}

async fn revoke_by_prefix(store: Arc<dyn Store>) {
    let key = key_secret::generate();
    let record = store
        .create_key("victim", None, &key, DEFAULTS)
        .await
        .unwrap();
    let revoked = store.revoke_key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(revoked.id, record.id);
    assert!(!revoked.is_active());
    let found = store.key(&key.prefix).await.unwrap().unwrap();
    assert!(!found.is_active());
}

async fn revoke_twice_keeps_first_time(store: Arc<dyn Store>) {
    let key = key_secret::generate();
    let record = store.create_key("k", None, &key, DEFAULTS).await.unwrap();
    let first = store.revoke_key(&key.prefix).await.unwrap().unwrap();
    // Let the clock pass a whole second, so a second stamp would differ.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = store
        .revoke_key(&record.id.to_string())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.revoked_at, first.revoked_at);
    let found = store.key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(found.revoked_at, first.revoked_at);
}

async fn revoke_unknown_is_none(store: Arc<dyn Store>) {
    let key = key_secret::generate();
    let record = store.create_key("k", None, &key, DEFAULTS).await.unwrap();
    for unknown in [
        (record.id + 1).to_string(),
        "0".to_owned(),
        "-1".to_owned(),
        "99999999999999999999999999".to_owned(),
        key_secret::generate().prefix,
        String::new(),
        "not a key".to_owned(),
    ] {
        assert_eq!(
            store.revoke_key(&unknown).await.unwrap(),
            None,
            "{unknown:?}"
        );
    }
    assert!(store.key(&key.prefix).await.unwrap().unwrap().is_active());
}

async fn duplicate_prefix_is_refused(store: Arc<dyn Store>) {
    let key = key_secret::generate();
    let record = store
        .create_key("original", None, &key, DEFAULTS)
        .await
        .unwrap();

    // Another key that happens to share the prefix.
    let mut clash: NewKey = key_secret::generate();
    clash.prefix = key.prefix.clone();
    match store.create_key("clash", None, &clash, DEFAULTS).await {
        Err(StoreError::Duplicate(prefix)) => assert_eq!(prefix, key.prefix),
        other => panic!("expected Duplicate, got {other:?}"),
    }

    // The original is untouched and nothing else was stored.
    let listed = store.list_keys().await.unwrap();
    assert_eq!(listed, [record]);
    // The store still works after the failed insert.
    store
        .create_key("next", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap();
}

/// Creating, revoking and re-limiting a key each give it the next change number; the
/// feed since a number returns exactly the keys changed after it, in change order, each
/// once with its latest state.
async fn key_feed_numbers_every_change_in_order(store: Arc<dyn Store>) {
    let records = |feed: &[KeyChange]| feed.iter().map(|c| c.record.clone()).collect::<Vec<_>>();
    assert!(store.keys_changed_since(0).await.unwrap().is_empty());
    let a = store
        .create_key("a", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap();
    let b = store
        .create_key("b", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap();
    let feed = store.keys_changed_since(0).await.unwrap();
    assert_eq!(records(&feed), [a.clone(), b.clone()]);
    assert!(feed[0].seq < feed[1].seq);
    let seen = feed[1].seq;
    assert!(store.keys_changed_since(seen).await.unwrap().is_empty());

    let revoked = store.revoke_key(&a.prefix).await.unwrap().unwrap();
    let feed = store.keys_changed_since(seen).await.unwrap();
    assert_eq!(records(&feed), std::slice::from_ref(&revoked));
    let seen = feed[0].seq;

    // A change of any limit is a change, share's too (the feed trigger watches each
    // column): (the key, the change).
    let changes = [
        (
            &b.prefix,
            LimitUpdate {
                max_concurrent: Some(Some(3)),
                ..LimitUpdate::default()
            },
        ),
        (
            &a.prefix,
            LimitUpdate {
                share: Some(Some(4)),
                ..LimitUpdate::default()
            },
        ),
    ];
    let mut changed = Vec::new();
    let mut seen = seen;
    for (prefix, update) in &changes {
        let record = store.set_limits(prefix, update).await.unwrap().unwrap();
        let feed = store.keys_changed_since(seen).await.unwrap();
        assert_eq!(records(&feed), std::slice::from_ref(&record));
        seen = feed[0].seq;
        changed.push(record);
    }
    let [limited, shared] = <[_; 2]>::try_from(changed).unwrap();
    assert_eq!(
        (limited.limits.max_concurrent, shared.limits.share),
        (Some(3), Some(4))
    );

    // From the start: each key once, as it is now, in the order of its last change.
    assert_eq!(
        records(&store.keys_changed_since(0).await.unwrap()),
        [limited, shared]
    );
}

/// A rotation keeps everything of the key but its hash, which becomes the previous one
/// (with its end) or is dropped (no grace); an expiry is set and cleared; each is a key
/// change the feed carries, so that every server's key table sees it.
async fn rotation_and_expiry_are_key_changes(store: Arc<dyn Store>) {
    let first = key_secret::generate();
    let created = store
        .create_expiring_key("r", Some("r@x"), &first, DEFAULTS, Some(4_000_000_000))
        .await
        .unwrap();
    assert_eq!(created.expires_at, Some(4_000_000_000));
    assert_eq!(
        (&created.previous_hash, created.previous_expires_at),
        (&None, None)
    );
    let seen = store.keys_changed_since(0).await.unwrap()[0].seq;

    let second = key_secret::generate_for_prefix(&first.prefix).unwrap();
    let until = now() + 60;
    let rotated = store
        .rotate_key(&first.prefix, &second.hash, Some(until))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        rotated,
        KeyRecord {
            hash: second.hash.to_vec(),
            previous_hash: Some(first.hash.to_vec()),
            previous_expires_at: Some(until),
            ..created.clone()
        }
    );
    let feed = store.keys_changed_since(seen).await.unwrap();
    assert_eq!(feed.len(), 1);
    assert_eq!(feed[0].record, rotated);
    let seen = feed[0].seq;

    // Again, by id: the secret just replaced is the previous one now; the first is gone.
    let third = key_secret::generate_for_prefix(&first.prefix).unwrap();
    let again = store
        .rotate_key(&created.id.to_string(), &third.hash, Some(until + 1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.hash, third.hash.to_vec());
    assert_eq!(again.previous_hash, Some(second.hash.to_vec()));
    assert_eq!(again.previous_expires_at, Some(until + 1));
    // No grace: no previous secret at all.
    let fourth = key_secret::generate_for_prefix(&first.prefix).unwrap();
    let now_only = store
        .rotate_key(&first.prefix, &fourth.hash, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (now_only.previous_hash, now_only.previous_expires_at),
        (None, None)
    );
    assert_eq!(now_only.hash, fourth.hash.to_vec());
    let feed = store.keys_changed_since(seen).await.unwrap();
    assert_eq!(feed.len(), 1);
    let seen = feed[0].seq;

    let cleared = store
        .set_expiry(&first.prefix, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cleared.expires_at, None);
    let feed = store.keys_changed_since(seen).await.unwrap();
    assert_eq!(feed.len(), 1);
    assert_eq!(feed[0].record, cleared);
    let set = store
        .set_expiry(&created.id.to_string(), Some(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(set.expires_at, Some(1));
    assert!(store.keys_changed_since(feed[0].seq).await.unwrap().len() == 1);
    assert_eq!(store.key(&first.prefix).await.unwrap().unwrap(), set);

    for unknown in ["fg-nosuchkey", "999999"] {
        assert!(
            store
                .rotate_key(unknown, &fourth.hash, None)
                .await
                .unwrap()
                .is_none()
        );
        assert!(store.set_expiry(unknown, None).await.unwrap().is_none());
    }
}

async fn ping(store: Arc<dyn Store>) {
    store.ping().await.unwrap();
}

async fn migrations_are_idempotent(url: &str) {
    let first = store::connect(url).await.unwrap();
    let key = key_secret::generate();
    let record = first
        .create_key("kept", None, &key, DEFAULTS)
        .await
        .unwrap();

    // A second process (the CLI beside a running server) opening the same database.
    let second = store::connect(url).await.unwrap();
    assert_eq!(second.key(&key.prefix).await.unwrap(), Some(record.clone()));
    let revoked = second.revoke_key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(first.key(&key.prefix).await.unwrap(), Some(revoked));
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
    let key = key_secret::generate();
    a.create_key("k", None, &key, DEFAULTS).await.unwrap();
    assert!(b.key(&key.prefix).await.unwrap().is_some());
    assert_eq!(c.list_keys().await.unwrap().len(), 1);
}

async fn existing_keys_get_default_limits(url: &str) {
    // A database as migration 0001 left it, with a key, then opened by this version.
    let key = key_secret::generate();
    if url.starts_with("sqlite:") {
        let path = sqlite_path(url);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        sqlx::migrate!("migrations/sqlite")
            .run_to(1, &pool)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO api_keys (name, prefix, key_hash, created_at) VALUES ('old', ?, ?, 1)",
        )
        .bind(&key.prefix)
        .bind(key.hash.as_slice())
        .execute(&pool)
        .await
        .unwrap();
        pool.close().await;
    } else {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        sqlx::migrate!("migrations/postgres")
            .run_to(1, &pool)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO api_keys (name, prefix, key_hash, created_at) VALUES ('old', $1, $2, 1)",
        )
        .bind(&key.prefix)
        .bind(key.hash.as_slice())
        .execute(&pool)
        .await
        .unwrap();
        pool.close().await;
    }

    let store = store::connect(url).await.unwrap();
    let record = store.key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(record.name, "old");
    assert_eq!(record.limits, LimitOverrides::default());
    // The key is in the change feed, and a change after the migration comes after it.
    let feed = store.keys_changed_since(0).await.unwrap();
    assert_eq!(feed.len(), 1);
    assert_eq!(feed[0].record, record);
    let newer = store
        .create_key("new", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap();
    let after = store.keys_changed_since(feed[0].seq).await.unwrap();
    assert_eq!(
        after.iter().map(|c| &c.record).collect::<Vec<_>>(),
        [&newer]
    );
    // And the new tables work on it.
    store
        .record_usage(&usage(record.id, "req_1", "2026-04", 1, 2))
        .await
        .unwrap();
    assert_eq!(store.month_usage(record.id, "2026-04").await.unwrap(), 3);
}

// ---------------------------------------------------------------------------------------
// Limits, usage ledger, request log (both backends)
// ---------------------------------------------------------------------------------------

const ALL_OWN: LimitOverrides = LimitOverrides {
    monthly_budget: Some(1_000),
    requests_per_minute: Some(5),
    max_concurrent: Some(2),
    max_queued: Some(0),
    share: Some(2),
};

/// The `share` column's CHECK keeps the key service's bounds (1 to 1000) for a write
/// that does not go through the store (an operator's SQL).
async fn the_schema_holds_share_to_its_bounds(url: &str) {
    let store = store::connect(url).await.unwrap();
    let key = key_secret::generate();
    store.create_key("k", None, &key, DEFAULTS).await.unwrap();
    let update = "UPDATE api_keys SET share = $1 WHERE prefix = $2";
    let set = |share: i32| {
        let prefix = key.prefix.clone();
        async move {
            if url.starts_with("sqlite:") {
                let options = sqlx::sqlite::SqliteConnectOptions::new().filename(sqlite_path(url));
                let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
                let done = sqlx::query(update)
                    .bind(share)
                    .bind(prefix)
                    .execute(&pool)
                    .await;
                pool.close().await;
                done.map(|_| ())
            } else {
                let pool = sqlx::PgPool::connect(url).await.unwrap();
                let done = sqlx::query(update)
                    .bind(share)
                    .bind(prefix)
                    .execute(&pool)
                    .await;
                pool.close().await;
                done.map(|_| ())
            }
        }
    };
    for refused in [0, -1, 1001] {
        assert!(set(refused).await.is_err(), "share = {refused}");
    }
    set(1000).await.unwrap();
    let record = store.key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(record.limits.share, Some(1000));
}

async fn create_with_limits(store: Arc<dyn Store>) {
    let plain = store
        .create_key("plain", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap();
    assert_eq!(plain.limits, LimitOverrides::default());

    let key = key_secret::generate();
    let own = store.create_key("own", None, &key, &ALL_OWN).await.unwrap();
    assert_eq!(own.limits, ALL_OWN);
    assert_eq!(store.key(&key.prefix).await.unwrap().unwrap(), own);

    // Some set, some default; the extremes the columns hold.
    let extremes = LimitOverrides {
        monthly_budget: Some(i64::MAX as u64),
        requests_per_minute: Some(i32::MAX as u32),
        max_concurrent: None,
        max_queued: Some(i32::MAX as u32),
        share: Some(1000),
    };
    let big = store
        .create_key("big", None, &key_secret::generate(), &extremes)
        .await
        .unwrap();
    assert_eq!(big.limits, extremes);
    let zero = LimitOverrides {
        monthly_budget: Some(0),
        requests_per_minute: Some(1),
        max_concurrent: Some(1),
        max_queued: Some(0),
        share: Some(1),
    };
    let small = store
        .create_key("small", None, &key_secret::generate(), &zero)
        .await
        .unwrap();
    assert_eq!(small.limits, zero);

    assert_eq!(store.list_keys().await.unwrap(), [plain, own, big, small]);
}

async fn set_and_clear_limits(store: Arc<dyn Store>) {
    let key = key_secret::generate();
    let record = store.create_key("k", None, &key, DEFAULTS).await.unwrap();
    let bystander = store
        .create_key("other", None, &key_secret::generate(), &ALL_OWN)
        .await
        .unwrap();

    // One limit, by prefix: the others stay as they are.
    let budget_only = LimitUpdate {
        monthly_budget: Some(Some(5_000)),
        ..LimitUpdate::default()
    };
    let updated = store
        .set_limits(&key.prefix, &budget_only)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        updated.limits,
        LimitOverrides {
            monthly_budget: Some(5_000),
            ..LimitOverrides::default()
        }
    );
    assert_eq!(
        KeyRecord {
            limits: LimitOverrides::default(),
            ..updated.clone()
        },
        record
    );

    // All of them, by id.
    let all = LimitUpdate {
        monthly_budget: Some(Some(7)),
        requests_per_minute: Some(Some(60)),
        max_concurrent: Some(Some(3)),
        max_queued: Some(Some(9)),
        share: Some(Some(5)),
    };
    let updated = store
        .set_limits(&record.id.to_string(), &all)
        .await
        .unwrap()
        .unwrap();
    let expected = LimitOverrides {
        monthly_budget: Some(7),
        requests_per_minute: Some(60),
        max_concurrent: Some(3),
        max_queued: Some(9),
        share: Some(5),
    };
    assert_eq!(updated.limits, expected);

    // An empty update changes nothing and returns the record.
    assert!(LimitUpdate::default().is_empty());
    let same = store
        .set_limits(&key.prefix, &LimitUpdate::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(same, updated);

    // Back to the default for three of them; the others are kept.
    let clear = LimitUpdate {
        requests_per_minute: Some(None),
        max_queued: Some(None),
        max_concurrent: Some(Some(4)),
        monthly_budget: None,
        share: Some(None),
    };
    let cleared = store
        .set_limits(&key.prefix, &clear)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        cleared.limits,
        LimitOverrides {
            monthly_budget: Some(7),
            requests_per_minute: None,
            max_concurrent: Some(4),
            max_queued: None,
            share: None,
        }
    );
    assert_eq!(store.key(&key.prefix).await.unwrap().unwrap(), cleared);

    // A revoked key's limits can still change.
    store.revoke_key(&key.prefix).await.unwrap().unwrap();
    let revoked = store
        .set_limits(&key.prefix, &budget_only)
        .await
        .unwrap()
        .unwrap();
    assert!(!revoked.is_active());
    assert_eq!(revoked.limits.monthly_budget, Some(5_000));

    // Unknown keys.
    for unknown in [
        (bystander.id + 1).to_string(),
        "99999999999999999999999".to_owned(),
        key_secret::generate().prefix,
        String::new(),
    ] {
        assert_eq!(
            store.set_limits(&unknown, &all).await.unwrap(),
            None,
            "{unknown:?}"
        );
    }

    // The other key was never touched.
    assert_eq!(
        store.key(&bystander.prefix).await.unwrap().unwrap(),
        bystander
    );
}

async fn invalid_limits_are_refused(store: Arc<dyn Store>) {
    let invalid = [
        LimitOverrides {
            requests_per_minute: Some(0),
            ..LimitOverrides::default()
        },
        LimitOverrides {
            max_concurrent: Some(0),
            ..LimitOverrides::default()
        },
        LimitOverrides {
            max_queued: Some(i32::MAX as u32 + 1),
            ..LimitOverrides::default()
        },
        LimitOverrides {
            monthly_budget: Some(i64::MAX as u64 + 1),
            ..LimitOverrides::default()
        },
        LimitOverrides {
            share: Some(0),
            ..LimitOverrides::default()
        },
        LimitOverrides {
            share: Some(1001),
            ..LimitOverrides::default()
        },
    ];
    for limits in &invalid {
        match store
            .create_key("bad", None, &key_secret::generate(), limits)
            .await
        {
            Err(StoreError::Invalid(message)) => assert!(!message.is_empty()),
            other => panic!("{limits:?}: expected Invalid, got {other:?}"),
        }
    }
    assert!(store.list_keys().await.unwrap().is_empty());

    let key = key_secret::generate();
    let record = store.create_key("k", None, &key, &ALL_OWN).await.unwrap();
    for limits in &invalid {
        let update = LimitUpdate {
            monthly_budget: limits.monthly_budget.map(Some),
            requests_per_minute: limits.requests_per_minute.map(Some),
            max_concurrent: limits.max_concurrent.map(Some),
            max_queued: limits.max_queued.map(Some),
            share: limits.share.map(Some),
        };
        // Invalid even for a key that does not exist: the value is checked first.
        for target in [key.prefix.clone(), "404".to_owned()] {
            assert!(
                matches!(
                    store.set_limits(&target, &update).await,
                    Err(StoreError::Invalid(_))
                ),
                "{update:?}"
            );
        }
    }
    assert_eq!(store.key(&key.prefix).await.unwrap().unwrap(), record);
}

async fn key_by_id_or_prefix(store: Arc<dyn Store>) {
    let key = key_secret::generate();
    let record = store.create_key("k", None, &key, &ALL_OWN).await.unwrap();
    let other = store
        .create_key("other", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap();
    assert_eq!(
        store.key(&record.id.to_string()).await.unwrap(),
        Some(record.clone())
    );
    assert_eq!(store.key(&key.prefix).await.unwrap(), Some(record.clone()));
    assert_eq!(store.key(&other.prefix).await.unwrap(), Some(other.clone()));

    let revoked = store.revoke_key(&key.prefix).await.unwrap().unwrap();
    assert_eq!(
        store.key(&record.id.to_string()).await.unwrap(),
        Some(revoked)
    );

    for unknown in [
        (other.id + 1).to_string(),
        "0".to_owned(),
        "-1".to_owned(),
        "99999999999999999999999999".to_owned(),
        key_secret::generate().prefix,
        String::new(),
        key.secret.expose().to_owned(),
    ] {
        assert_eq!(store.key(&unknown).await.unwrap(), None, "{unknown:?}");
    }
}

/// A NUL character, which PostgreSQL's `TEXT` cannot hold, the same on both backends: a
/// name or e-mail with one is refused as invalid, naming the field (not a database
/// error: the admin API answered those with 500), and an id or prefix with one matches
/// no key.
async fn text_with_nul_is_invalid_or_matches_no_key(store: Arc<dyn Store>) {
    for (name, email, field) in [
        ("a\0b", None, "name"),
        ("ok", Some("a\0@example.org"), "email"),
    ] {
        match store
            .create_key(name, email, &key_secret::generate(), DEFAULTS)
            .await
        {
            Err(StoreError::Invalid(message)) => assert!(message.starts_with(field), "{message}"),
            other => panic!("{name:?}, {email:?}: expected Invalid, got {other:?}"),
        }
    }
    assert!(store.list_keys().await.unwrap().is_empty());

    let key = key_secret::generate();
    store.create_key("k", None, &key, DEFAULTS).await.unwrap();
    let change = LimitUpdate {
        max_queued: Some(Some(3)),
        ..LimitUpdate::default()
    };
    for selector in ["\0", "1\0", &format!("{}\0", key.prefix)] {
        assert_eq!(store.key(selector).await.unwrap(), None, "{selector:?}");
        assert_eq!(store.revoke_key(selector).await.unwrap(), None);
        assert_eq!(store.set_limits(selector, &change).await.unwrap(), None);
    }
    let kept = store.key(&key.prefix).await.unwrap().unwrap();
    assert!(kept.is_active() && kept.limits.max_queued.is_none());
}

fn usage(key_id: i64, request_id: &str, month: &str, prompt: u64, completion: u64) -> UsageRow {
    UsageRow {
        key_id,
        request_id: request_id.to_owned(),
        month: month.to_owned(),
        prompt_tokens: prompt,
        completion_tokens: completion,
        created_at: now(),
    }
}

async fn usage_sums_by_key_and_month(store: Arc<dyn Store>) {
    let a = store
        .create_key("a", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap()
        .id;
    let b = store
        .create_key("b", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap()
        .id;
    assert_eq!(store.month_usage(a, "2026-04").await.unwrap(), 0);

    for row in [
        usage(a, "req_1", "2026-04", 10, 5),
        usage(a, "req_2", "2026-04", 100, 0),
        usage(a, "req_3", "2026-05", 1, 2),
        usage(b, "req_4", "2026-04", 1_000, 1_000),
        usage(b, "req_5", "2026-05", 0, 0),
        usage(b, "req_6", "2026-05", 40, 2),
    ] {
        store.record_usage(&row).await.unwrap();
    }
    assert_eq!(store.month_usage(a, "2026-04").await.unwrap(), 115);
    assert_eq!(store.month_usage(a, "2026-05").await.unwrap(), 3);
    assert_eq!(store.month_usage(b, "2026-04").await.unwrap(), 2_000);
    assert_eq!(store.month_usage(b, "2026-05").await.unwrap(), 42);
    assert_eq!(store.month_usage(a, "2026-06").await.unwrap(), 0);
    assert_eq!(store.month_usage(b + 1, "2026-04").await.unwrap(), 0);
    assert_eq!(store.month_usage(a, "not a month").await.unwrap(), 0);

    // Large counts add up exactly (beyond 32 bits).
    let big = 3_000_000_000_u64;
    store
        .record_usage(&usage(a, "req_big", "2026-07", big, big))
        .await
        .unwrap();
    assert_eq!(store.month_usage(a, "2026-07").await.unwrap(), 2 * big);
}

async fn usage_is_idempotent(store: Arc<dyn Store>) {
    let a = store
        .create_key("a", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap()
        .id;
    let b = store
        .create_key("b", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap()
        .id;
    let row = usage(a, "req_retry", "2026-04", 30, 12);
    store.record_usage(&row).await.unwrap();
    // A retry, even one with other counts, another month or another key, counts nothing.
    store.record_usage(&row).await.unwrap();
    store
        .record_usage(&usage(a, "req_retry", "2026-04", 999, 999))
        .await
        .unwrap();
    store
        .record_usage(&usage(a, "req_retry", "2026-05", 1, 1))
        .await
        .unwrap();
    store
        .record_usage(&usage(b, "req_retry", "2026-04", 1, 1))
        .await
        .unwrap();
    assert_eq!(store.month_usage(a, "2026-04").await.unwrap(), 42);
    assert_eq!(store.month_usage(a, "2026-05").await.unwrap(), 0);
    assert_eq!(store.month_usage(b, "2026-04").await.unwrap(), 0);

    // Concurrent duplicates (two replicas settling the same request).
    let rows: Vec<_> = (0..8)
        .map(|_| usage(a, "req_race", "2026-06", 5, 5))
        .collect();
    let results = futures_util::future::join_all(rows.iter().map(|r| store.record_usage(r))).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(store.month_usage(a, "2026-06").await.unwrap(), 10);
}

async fn usage_refuses_bad_rows(store: Arc<dyn Store>) {
    let a = store
        .create_key("a", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap()
        .id;
    for month in [
        "2026-4",
        "2026-00",
        "2026-13",
        "26-04",
        "2026/04",
        "",
        "2026-04-01",
    ] {
        assert!(
            matches!(
                store.record_usage(&usage(a, "req_m", month, 1, 1)).await,
                Err(StoreError::Invalid(_))
            ),
            "{month:?}"
        );
    }
    assert!(matches!(
        store
            .record_usage(&usage(a, "req_t", "2026-04", u64::MAX, 0))
            .await,
        Err(StoreError::Invalid(_))
    ));
    // The ledger refers to keys.
    assert!(matches!(
        store
            .record_usage(&usage(a + 100, "req_k", "2026-04", 1, 1))
            .await,
        Err(StoreError::Database(_))
    ));
    assert_eq!(store.month_usage(a, "2026-04").await.unwrap(), 0);
    // Nothing was kept of the refused rows: their ids are still free.
    store
        .record_usage(&usage(a, "req_k", "2026-04", 1, 1))
        .await
        .unwrap();
    assert_eq!(store.month_usage(a, "2026-04").await.unwrap(), 2);
}

/// A batch as the ledger writer sends it — of any size, so over several statements
/// where the backend splits it — is written whole or not at all, and once.
async fn usage_batches_are_all_or_none(store: Arc<dyn Store>) {
    let a = store
        .create_key("a", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap()
        .id;
    let batch = |from: usize, n: usize| -> Vec<UsageRow> {
        (from..from + n)
            .map(|i| usage(a, &format!("req_{i}"), "2026-04", i as u64, 1))
            .collect()
    };
    let tokens = |rows: &[UsageRow]| -> u64 { rows.iter().map(|r| r.prompt_tokens + 1).sum() };
    // 1 + 100 + 7 rows, and the 100 again (a retry after an unclear commit).
    let (one, hundred, seven) = (batch(0, 1), batch(1, 100), batch(101, 7));
    for rows in [&one, &hundred, &seven, &hundred] {
        store.record_usages(rows).await.unwrap();
    }
    let written = tokens(&one) + tokens(&hundred) + tokens(&seven);
    assert_eq!(store.month_usage(a, "2026-04").await.unwrap(), written);

    // A row the database refuses (an unknown key) last in a batch of 100: none of the 99
    // before it is kept, and their ids are still free.
    let mut refused = batch(200, 99);
    refused.push(usage(a + 100, "req_unknown_key", "2026-04", 1, 1));
    assert!(matches!(
        store.record_usages(&refused).await,
        Err(StoreError::Database(_))
    ));
    assert_eq!(store.month_usage(a, "2026-04").await.unwrap(), written);
    store.record_usages(&refused[..99]).await.unwrap();
    assert_eq!(
        store.month_usage(a, "2026-04").await.unwrap(),
        written + tokens(&refused[..99])
    );
    store.record_usages(&[]).await.unwrap();
}

pub(crate) fn log_row(request_id: &str, created_at_ms: i64) -> RequestLogRow {
    RequestLogRow {
        request_id: request_id.to_owned(),
        created_at_ms,
        key_id: None,
        key_prefix: None,
        email: None,
        client_ip: None,
        endpoint: "/v1/completions".to_owned(),
        model: None,
        prompt_tokens: None,
        completion_tokens: None,
        status: 401,
        error_code: None,
        latency_ms: 0,
        workload: None,
        queue_wait_ms: None,
    }
}

/// `requests` filters by key, model, status (exact or class) and time, newest first;
/// `spend` sums requests and tokens per UTC day, key and model.
async fn request_log_filters_and_spend_by_day(store: Arc<dyn Store>) {
    const DAY: i64 = 86_400_000;
    let day0 = 20_000 * DAY; // 2024-10-04
    let row =
        |id: &str, at: i64, key: i64, model: &str, status: u16, tokens: (u64, u64)| RequestLogRow {
            key_id: Some(key),
            key_prefix: Some(format!("fg-k{key}")),
            model: Some(model.to_owned()),
            status,
            prompt_tokens: Some(tokens.0),
            completion_tokens: Some(tokens.1),
            ..log_row(id, at)
        };
    store
        .append_request_log(&[
            row("a1", day0 + 10, 1, "m", 200, (10, 5)),
            row("a2", day0 + 20, 1, "m", 429, (0, 0)),
            row("a3", day0 + DAY + 5, 1, "m", 200, (7, 3)),
            row("a4", day0 + DAY + 6, 1, "n", 503, (4, 0)),
            row("b1", day0 + 30, 2, "m", 200, (1, 1)),
            // No key (a 401): never in anyone's spend.
            log_row("anon", day0 + 40),
        ])
        .await
        .unwrap();
    let ids = |rows: Vec<RequestLogRow>| -> Vec<String> {
        rows.into_iter().map(|r| r.request_id).collect()
    };
    let query = |q: RequestQuery| {
        let store = Arc::clone(&store);
        async move {
            ids(store
                .requests(&RequestQuery { limit: 100, ..q })
                .await
                .unwrap())
        }
    };
    assert_eq!(
        query(RequestQuery {
            key_id: Some(1),
            ..RequestQuery::default()
        })
        .await,
        ["a4", "a3", "a2", "a1"]
    );
    assert_eq!(
        query(RequestQuery {
            model: Some("n".into()),
            ..RequestQuery::default()
        })
        .await,
        ["a4"]
    );
    assert_eq!(
        query(RequestQuery {
            status: Some(StatusMatch::Class(4)),
            ..RequestQuery::default()
        })
        .await,
        ["anon", "a2"]
    );
    assert_eq!(
        query(RequestQuery {
            status: Some(StatusMatch::Exact(200)),
            key_id: Some(1),
            ..RequestQuery::default()
        })
        .await,
        ["a3", "a1"]
    );
    assert_eq!(
        query(RequestQuery {
            since_ms: Some(day0 + 20),
            until_ms: Some(day0 + 40),
            ..RequestQuery::default()
        })
        .await,
        ["b1", "a2"]
    );
    assert_eq!(
        ids(store
            .requests(&RequestQuery {
                limit: 2,
                ..RequestQuery::default()
            })
            .await
            .unwrap()),
        ["a4", "a3"]
    );

    let spend = store.spend(&SpendQuery::default()).await.unwrap();
    let day =
        |d: i64, key: i64, model: &str, requests: u64, prompt: u64, completion: u64| SpendRow {
            day: day0 / DAY + d,
            key_id: key,
            key_prefix: Some(format!("fg-k{key}")),
            model: Some(model.to_owned()),
            requests,
            prompt_tokens: prompt,
            completion_tokens: completion,
        };
    assert_eq!(
        spend,
        [
            day(0, 1, "m", 2, 10, 5),
            day(0, 2, "m", 1, 1, 1),
            day(1, 1, "m", 1, 7, 3),
            day(1, 1, "n", 1, 4, 0),
        ]
    );
    let second_day = store
        .spend(&SpendQuery {
            key_id: Some(1),
            since_ms: Some(day0 + DAY),
            until_ms: None,
        })
        .await
        .unwrap();
    assert_eq!(
        second_day,
        [day(1, 1, "m", 1, 7, 3), day(1, 1, "n", 1, 4, 0)]
    );
}

async fn request_log_round_trip(store: Arc<dyn Store>) {
    assert!(store.recent_requests(10).await.unwrap().is_empty());
    store.append_request_log(&[]).await.unwrap();

    let key = store
        .create_key(
            "k",
            Some("k@example.org"),
            &key_secret::generate(),
            DEFAULTS,
        )
        .await
        .unwrap();
    let full = RequestLogRow {
        request_id: "req_full".to_owned(),
        created_at_ms: 1_780_000_000_123,
        key_id: Some(key.id),
        key_prefix: Some(key.prefix.clone()),
        email: key.email.clone(),
        client_ip: Some("203.0.113.7".parse().unwrap()),
        endpoint: "/v1/completions".to_owned(),
        model: Some("llama-8b".to_owned()),
        prompt_tokens: Some(12),
        completion_tokens: Some(3_000_000_000),
        status: 200,
        error_code: None,
        latency_ms: 1_234,
        workload: Some("api".to_owned()),
        queue_wait_ms: Some(321),
    };
    let failed = RequestLogRow {
        client_ip: Some("2001:db8::1".parse().unwrap()),
        error_code: Some("invalid_api_key".to_owned()),
        ..log_row("req_nulls", 1_780_000_000_124)
    };
    // Counts beyond the column saturate rather than failing the batch.
    let huge = RequestLogRow {
        prompt_tokens: Some(u64::MAX),
        latency_ms: u64::MAX,
        status: u16::MAX,
        ..log_row("req_huge", 1_780_000_000_000)
    };
    store
        .append_request_log(&[full.clone(), failed.clone(), huge.clone()])
        .await
        .unwrap();

    let recent = store.recent_requests(10).await.unwrap();
    let saturated = RequestLogRow {
        prompt_tokens: Some(i64::MAX as u64),
        latency_ms: i64::MAX as u64,
        ..huge
    };
    assert_eq!(recent, [failed.clone(), full.clone(), saturated]);
    assert_eq!(
        store.recent_requests(1).await.unwrap(),
        std::slice::from_ref(&failed)
    );
    assert!(store.recent_requests(0).await.unwrap().is_empty());

    // A row already logged (a batch retried after an unclear commit) is skipped; the
    // rest of its batch is written.
    let later = log_row("req_later", 1_780_000_000_200);
    store
        .append_request_log(&[
            RequestLogRow {
                status: 500,
                ..full.clone()
            },
            later.clone(),
        ])
        .await
        .unwrap();
    let recent = store.recent_requests(10).await.unwrap();
    assert_eq!(recent.len(), 4);
    assert_eq!(recent[0], later);
    assert_eq!(recent[2], full);
}

/// Distinct rows for the writer tests.
fn numbered_rows(from: usize, count: usize) -> Vec<RequestLogRow> {
    (from..from + count)
        .map(|i| RequestLogRow {
            prompt_tokens: Some(i as u64),
            ..log_row(&format!("req_{i:05}"), 1_780_000_000_000 + i as i64)
        })
        .collect()
}

async fn request_log_writer_close_writes_everything(store: Arc<dyn Store>) {
    let log = RequestLog::start(store.clone());
    let clone = log.clone();
    for row in numbered_rows(0, 1000) {
        clone.record(row);
    }
    let stats = tokio::time::timeout(Duration::from_secs(30), log.close())
        .await
        .expect("close finishes");
    assert_eq!(
        stats,
        RequestLogStats {
            written: 1000,
            dropped: 0,
            failed: 0
        }
    );
    let rows = store.recent_requests(5000).await.unwrap();
    assert_eq!(rows.len(), 1000);
    let mut ids: Vec<_> = rows.iter().map(|r| r.request_id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 1000);
    assert_eq!(rows[0], numbered_rows(999, 1)[0]);

    // Closed: later rows (on a remaining clone) are dropped and counted; flush and close
    // return at once.
    clone.record(numbered_rows(1000, 1).remove(0));
    clone.flush().await;
    assert_eq!(clone.stats().dropped, 1);
    let again = clone.close().await;
    assert_eq!(again.written, 1000);
    assert_eq!(store.recent_requests(5000).await.unwrap().len(), 1000);
}

/// A request log writing `batch_rows` rows at once, or what waits after `max_delay`.
fn batched_log(store: Arc<dyn Store>, batch_rows: usize, max_delay: Duration) -> RequestLog {
    RequestLog::start_with(
        store,
        RequestLogConfig {
            batch_rows,
            max_delay,
            ..RequestLogConfig::default()
        },
    )
}

async fn request_log_writer_flush(store: Arc<dyn Store>) {
    // A batch would otherwise wait an hour or 10 000 rows: only flush writes it.
    let log = batched_log(store.clone(), 10_000, Duration::from_secs(3600));
    for row in numbered_rows(0, 3) {
        log.record(row);
    }
    tokio::time::timeout(Duration::from_secs(10), log.flush())
        .await
        .expect("flush finishes");
    assert_eq!(store.recent_requests(10).await.unwrap().len(), 3);
    assert_eq!(log.stats().written, 3);

    // Rows recorded from other tasks before the flush are written by it too.
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let log = log.clone();
            tokio::spawn(async move {
                for row in numbered_rows(100 * (t + 1), 25) {
                    log.record(row);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), log.flush())
        .await
        .expect("flush finishes");
    assert_eq!(store.recent_requests(1000).await.unwrap().len(), 103);
    // A flush with nothing queued returns too.
    tokio::time::timeout(Duration::from_secs(10), log.flush())
        .await
        .expect("flush finishes");
    assert_eq!(log.close().await.written, 103);
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
    let key = key_secret::generate();
    store.create_key("k", None, &key, DEFAULTS).await.unwrap();
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
    let key = key_secret::generate();
    let record = a.create_key("k", None, &key, DEFAULTS).await.unwrap();
    // Kept across queries (one long-lived connection)...
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(a.key(&key.prefix).await.unwrap(), Some(record));
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
    match store::connect("sqlite://").await {
        Err(StoreError::Open { source, .. }) => {
            assert!(matches!(*source, StoreError::InvalidUrl(_)), "{source:?}")
        }
        Err(other) => panic!("expected Open(InvalidUrl), got {other:?}"),
        Ok(_) => panic!("expected Open(InvalidUrl), got a store"),
    }
}

/// A PostgreSQL store on a port nobody listens on: the error says at once which URL
/// (without its password) and why, instead of "pool timed out" after the pool's wait.
#[tokio::test]
async fn a_store_that_cannot_be_reached_is_named_with_its_cause() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://fleetgate:hunter2@127.0.0.1:{port}/fleetgate");
    let Err(err) = store::connect(&url).await else {
        panic!("connected to a closed port")
    };
    let message = format!("{:#}", anyhow::Error::new(err));
    assert!(
        message.contains(&format!(
            "postgres://fleetgate:***@127.0.0.1:{port}/fleetgate"
        )),
        "{message}"
    );
    assert!(!message.contains("hunter2"), "{message}");
    assert!(message.to_lowercase().contains("refused"), "{message}");
    assert!(!message.contains("timed out"), "{message}");
}

/// A store that reports every `append_request_log` call (its row count, and whether it
/// failed) and can be told to fail the next few; and counts reads of the key change
/// feed and usage ledger writes, which it can be told to fail.
pub(crate) struct WatchedStore {
    inner: Arc<dyn Store>,
    appends: tokio::sync::mpsc::UnboundedSender<(usize, bool)>,
    failures_left: std::sync::atomic::AtomicU32,
    pub(crate) feed_reads: std::sync::atomic::AtomicU32,
    pub(crate) feed_down: std::sync::atomic::AtomicBool,
    /// Feed reads never answer (a store that accepts the query and goes silent).
    pub(crate) feed_stalled: std::sync::atomic::AtomicBool,
    pub(crate) usage_writes: std::sync::atomic::AtomicU32,
    pub(crate) usage_down: std::sync::atomic::AtomicBool,
}

impl WatchedStore {
    pub(crate) fn new(
        inner: Arc<dyn Store>,
        failures: u32,
    ) -> (
        Arc<Self>,
        tokio::sync::mpsc::UnboundedReceiver<(usize, bool)>,
    ) {
        let (appends, rx) = tokio::sync::mpsc::unbounded_channel();
        let store = Arc::new(Self {
            inner,
            appends,
            failures_left: failures.into(),
            feed_reads: 0.into(),
            feed_down: false.into(),
            feed_stalled: false.into(),
            usage_writes: 0.into(),
            usage_down: false.into(),
        });
        (store, rx)
    }
}

#[async_trait::async_trait]
impl Store for WatchedStore {
    async fn create_expiring_key(
        &self,
        name: &str,
        email: Option<&str>,
        key: &NewKey,
        limits: &LimitOverrides,
        expires_at: Option<i64>,
    ) -> Result<KeyRecord, StoreError> {
        self.inner
            .create_expiring_key(name, email, key, limits, expires_at)
            .await
    }
    async fn rotate_key(
        &self,
        id_or_prefix: &str,
        hash: &[u8; 32],
        previous_until: Option<i64>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        self.inner
            .rotate_key(id_or_prefix, hash, previous_until)
            .await
    }
    async fn set_expiry(
        &self,
        id_or_prefix: &str,
        expires_at: Option<i64>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        self.inner.set_expiry(id_or_prefix, expires_at).await
    }
    async fn keys_changed_since(&self, since: i64) -> Result<Vec<KeyChange>, StoreError> {
        self.feed_reads
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.feed_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(StoreError::Database(sqlx::Error::PoolTimedOut));
        }
        if self.feed_stalled.load(std::sync::atomic::Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.keys_changed_since(since).await
    }
    async fn key(&self, id_or_prefix: &str) -> Result<Option<KeyRecord>, StoreError> {
        self.inner.key(id_or_prefix).await
    }
    async fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        self.inner.list_keys().await
    }
    async fn revoke_key(&self, id_or_prefix: &str) -> Result<Option<KeyRecord>, StoreError> {
        self.inner.revoke_key(id_or_prefix).await
    }
    async fn set_limits(
        &self,
        id_or_prefix: &str,
        update: &LimitUpdate,
    ) -> Result<Option<KeyRecord>, StoreError> {
        self.inner.set_limits(id_or_prefix, update).await
    }
    async fn record_usages(&self, rows: &[UsageRow]) -> Result<(), StoreError> {
        self.usage_writes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.usage_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(StoreError::Database(sqlx::Error::PoolTimedOut));
        }
        self.inner.record_usages(rows).await
    }
    async fn month_usage(&self, key_id: i64, month: &str) -> Result<u64, StoreError> {
        self.inner.month_usage(key_id, month).await
    }
    async fn append_request_log(&self, rows: &[RequestLogRow]) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering;
        let fail = self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        // Reported once the attempt is over, so a test that saw it can read the rows.
        let result = if fail {
            Err(StoreError::Database(sqlx::Error::PoolTimedOut))
        } else {
            self.inner.append_request_log(rows).await
        };
        let _ = self.appends.send((rows.len(), fail));
        result
    }
    async fn requests(&self, query: &RequestQuery) -> Result<Vec<RequestLogRow>, StoreError> {
        self.inner.requests(query).await
    }
    async fn delete_requests_before(&self, before_ms: i64, limit: u32) -> Result<u64, StoreError> {
        self.inner.delete_requests_before(before_ms, limit).await
    }
    async fn spend(&self, query: &SpendQuery) -> Result<Vec<SpendRow>, StoreError> {
        self.inner.spend(query).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
    fn jobs(&self) -> &dyn fleetgate::store::JobStore {
        self.inner.jobs()
    }
    fn workbench(&self) -> &dyn fleetgate::store::workbench::WorkbenchStore {
        self.inner.workbench()
    }
}

/// The next `append_request_log` call, within 10 s.
async fn next_append(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<(usize, bool)>,
) -> (usize, bool) {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a batch is written in time")
        .expect("the store is alive")
}

#[tokio::test]
async fn request_log_writes_full_batches_at_once() {
    let db = TestDb::sqlite();
    let (store, mut appends) = WatchedStore::new(db.store().await, 0);
    let log = batched_log(store.clone(), 10, Duration::from_secs(3600));
    for row in numbered_rows(0, 25) {
        log.record(row);
    }
    assert_eq!(next_append(&mut appends).await, (10, false));
    assert_eq!(next_append(&mut appends).await, (10, false));
    assert_eq!(log.close().await.written, 25);
    assert_eq!(appends.recv().await, Some((5, false)));
    assert_eq!(store.recent_requests(100).await.unwrap().len(), 25);
}

#[tokio::test]
async fn request_log_writes_a_waiting_batch_after_max_delay() {
    let db = TestDb::sqlite();
    let (store, mut appends) = WatchedStore::new(db.store().await, 0);
    let log = batched_log(store.clone(), 10_000, Duration::from_millis(50));
    for row in numbered_rows(0, 3) {
        log.record(row);
    }
    // Neither flush nor close: the deadline writes the batch.
    assert_eq!(next_append(&mut appends).await, (3, false));
    assert_eq!(store.recent_requests(10).await.unwrap().len(), 3);
    // And again for a later batch.
    log.record(numbered_rows(3, 1).remove(0));
    assert_eq!(next_append(&mut appends).await, (1, false));
    assert_eq!(log.close().await.written, 4);
}

#[tokio::test]
async fn request_log_retries_failed_batches_then_drops_them() {
    let db = TestDb::sqlite();
    // Two failures, then success: written on the third attempt.
    let (store, mut appends) = WatchedStore::new(db.store().await, 2);
    let config = RequestLogConfig {
        write_attempts: 3,
        retry_delay: Duration::from_millis(1),
        ..RequestLogConfig::default()
    };
    let log = RequestLog::start_with(store.clone(), config.clone());
    for row in numbered_rows(0, 4) {
        log.record(row);
    }
    log.flush().await;
    assert_eq!(next_append(&mut appends).await, (4, true));
    assert_eq!(next_append(&mut appends).await, (4, true));
    assert_eq!(next_append(&mut appends).await, (4, false));
    assert_eq!(
        log.close().await,
        RequestLogStats {
            written: 4,
            dropped: 0,
            failed: 0
        }
    );

    // Failing every attempt: the batch is dropped and counted, flush still returns, and
    // the writer goes on with the next batch.
    let (store, mut appends) = WatchedStore::new(db.store().await, 3);
    let log = RequestLog::start_with(store.clone(), config);
    for row in numbered_rows(100, 5) {
        log.record(row);
    }
    log.flush().await;
    for _ in 0..3 {
        assert_eq!(next_append(&mut appends).await, (5, true));
    }
    assert_eq!(log.stats().failed, 5);
    log.record(numbered_rows(200, 1).remove(0));
    log.flush().await;
    assert_eq!(next_append(&mut appends).await, (1, false));
    assert_eq!(
        log.close().await,
        RequestLogStats {
            written: 1,
            dropped: 0,
            failed: 5
        }
    );
    assert_eq!(store.recent_requests(100).await.unwrap().len(), 5);
}

#[tokio::test]
async fn request_log_drops_rows_when_the_queue_is_full() {
    let db = TestDb::sqlite();
    let store = db.store().await;
    let log = RequestLog::start_with(
        store.clone(),
        RequestLogConfig {
            capacity: 4,
            ..RequestLogConfig::default()
        },
    );
    // A current-thread runtime: the writer cannot run while this loop does, so the queue
    // takes 4 rows and refuses the rest, without waiting.
    for row in numbered_rows(0, 10) {
        log.record(row);
    }
    assert_eq!(log.stats().dropped, 6);
    log.flush().await;
    assert_eq!(
        log.close().await,
        RequestLogStats {
            written: 4,
            dropped: 6,
            failed: 0
        }
    );
    let ids: Vec<_> = store
        .recent_requests(10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.request_id)
        .collect();
    assert_eq!(ids, ["req_00003", "req_00002", "req_00001", "req_00000"]);
}

#[tokio::test]
async fn sqlite_month_usage_reads_the_index_only() {
    let db = TestDb::sqlite();
    let store = SqliteStore::connect(&db.url).await.unwrap();
    let rows = sqlx::query(
        "EXPLAIN QUERY PLAN SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) \
         FROM usage_ledger WHERE key_id = 1 AND month = '2026-04'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    let detail: Vec<String> = rows
        .iter()
        .map(|r| sqlx::Row::get::<String, _>(r, "detail"))
        .collect();
    assert!(
        detail
            .iter()
            .any(|d| d.contains("USING COVERING INDEX usage_ledger_key_month")),
        "{detail:?}"
    );
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

/// PostgreSQL announces key changes (the key feed trigger's NOTIFY): a signal arrives
/// for a key created through another connection. SQLite announces nothing.
#[tokio::test]
#[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
async fn postgres_signals_key_changes() {
    use futures_util::StreamExt as _;
    let db = TestDb::postgres().await;
    let listening = db.store().await;
    let mut signals = listening
        .key_change_signals()
        .await
        .expect("PostgreSQL listens");
    let elsewhere = db.store().await;
    elsewhere
        .create_key("k", None, &key_secret::generate(), DEFAULTS)
        .await
        .unwrap();
    let signal = tokio::time::timeout(Duration::from_secs(5), signals.next()).await;
    assert_eq!(signal.expect("a signal within 5 s"), Some(()));

    let sqlite = TestDb::sqlite();
    assert!(sqlite.store().await.key_change_signals().await.is_none());
}
