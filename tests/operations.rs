//! The operator's commands that start nothing, run as the real binary: `config check`
//! (every problem of a file at once, with its line; exit status for CI), the store
//! scheme checks `serve` makes before it opens anything, and `backup` of a SQLite store
//! while a server writes to it, restored by pointing `database_url` at the copy.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

/// The parts of the shared harness (`tests/common`) these tests use.
mod common {
    pub mod cli;
    pub mod postgres;
    #[expect(
        dead_code,
        reason = "no signals sent, no node's requests counted: these tests stop nothing midway"
    )]
    pub mod processes;
}

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::cli::{create_key, fleetgate};
use common::processes::{FLEETGATE, serve, start_mock};

/// A config `name` in `dir` on port 0 with its store at `database_url`, one model on
/// `upstream`.
fn write_config(dir: &Path, name: &str, database_url: &str, upstream: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\ndatabase_url = \"{database_url}\"\n\n[[models]]\nid = \"llama-8b\"\n\n[[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"gpu-a\"\n"
        ),
    )
    .unwrap();
    path
}

/// The `sqlite://` URL of the file `database`.
fn sqlite(database: &Path) -> String {
    format!("sqlite://{}", database.display())
}

/// `fleetgate ARGS --config CONFIG` with `env` set, success or not.
fn run(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(FLEETGATE)
        .args(args)
        .arg("--config")
        .arg(config)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

#[test]
fn config_check_says_every_problem_with_its_line_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "listen = \"127.0.0.1:0\"\n\
         redis_url = \"http://cache:6379\"\n\
         [limits]\n\
         rpm = 3\n\
         [fleet]\n\
         prefix_bytes = \"big\"\n\
         [[models]]\n\
         id = \"m\"\n\
         [[models.upstreams]]\n\
         url = \"ftp://127.0.0.1:1\"\n\
         gpu = \"g\"\n",
    )
    .unwrap();
    let checked = run(
        &path,
        &["config", "check"],
        &[("FLEETGATE_LIMITS__SHARE", "0")],
    );
    assert_eq!(checked.status.code(), Some(1));
    let stderr = String::from_utf8(checked.stderr).unwrap();
    let file = path.display();
    let lines: Vec<&str> = stderr.lines().collect();
    let expected = [
        format!(
            "{file}:2:1: redis_url must start with redis://, rediss:// (TLS), unix:// or redis+unix://"
        ),
        format!("{file}:4:1: in [limits]: unknown key `rpm`"),
        format!("{file}:6:1: fleet.prefix_bytes: invalid type"),
        format!("{file}:10:1: models.upstreams.url of 'm' must be an http(s) URL"),
        "FLEETGATE_LIMITS__SHARE (environment): limits.share must be between 1 and 1000 (got 0)"
            .to_owned(),
        format!("error: 5 problems in {file}"),
    ];
    assert_eq!(lines.len(), expected.len(), "{stderr}");
    for (line, expected) in lines.iter().zip(&expected) {
        assert!(line.starts_with(expected.as_str()), "{line}\nin:\n{stderr}");
    }
    assert!(checked.stdout.is_empty());

    // `serve` refuses the same file saying the same problems, on one line.
    let served = run(&path, &["serve"], &[]);
    assert!(!served.status.success());
    let stderr = String::from_utf8(served.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("line 4: in [limits]: unknown key `rpm`"),
        "{stderr}"
    );
    assert!(stderr.contains("line 10: models.upstreams.url"), "{stderr}");
}

#[test]
fn config_check_passes_a_good_file_with_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("fg.db");
    let path = write_config(
        dir.path(),
        "good.toml",
        &sqlite(&database),
        "http://127.0.0.1:1",
    );
    // A variable still overrides the file.
    let checked = run(
        &path,
        &["config", "check"],
        &[("FLEETGATE_OPS_LISTEN", "127.0.0.1:9199")],
    );
    assert_eq!(
        checked.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let stdout = String::from_utf8(checked.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    for said in [
        ": ok: 1 model (llama-8b) on 1 node",
        "listening on 127.0.0.1:0 (API), 127.0.0.1:9199 (ops)",
        &format!("store sqlite://{}", database.display()),
        "counters in process",
    ] {
        assert!(stdout.contains(said), "{said} in {stdout}");
    }
    assert!(!database.exists(), "a check opens no store");
}

/// A Redis URL of the wrong scheme stops `serve` before it opens (and so migrates, or
/// here creates) its database.
#[test]
fn serve_refuses_a_bad_store_scheme_before_opening_the_database() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("fg.db");
    let path = write_config(
        dir.path(),
        "fleetgate.toml",
        &sqlite(&database),
        "http://127.0.0.1:1",
    );
    let served = run(
        &path,
        &["serve"],
        &[("FLEETGATE_REDIS_URL", "http://cache:6379")],
    );
    assert!(!served.status.success());
    let stderr = String::from_utf8(served.stderr).unwrap();
    assert!(
        stderr.contains("FLEETGATE_REDIS_URL: redis_url must start with redis://"),
        "{stderr}"
    );
    assert!(!database.exists(), "the database was not touched");
}

/// The same on PostgreSQL: the database is not migrated (it has no migration table).
#[tokio::test]
#[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
async fn serve_refuses_a_bad_store_scheme_before_migrating_postgres() {
    use sqlx::Connection as _;
    let database = common::postgres::FreshDatabase::create("fg_scheme").await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "pg.toml", &database.url, "http://127.0.0.1:1");
    let bad = [("FLEETGATE_REDIS_URL", "http://cache:6379")];
    let served = tokio::task::spawn_blocking(move || run(&config, &["serve"], &bad))
        .await
        .unwrap();
    assert!(!served.status.success());
    let stderr = String::from_utf8(served.stderr).unwrap();
    assert!(
        stderr.contains("FLEETGATE_REDIS_URL: redis_url must start with redis://"),
        "{stderr}"
    );
    let mut db = sqlx::PgConnection::connect(&database.url).await.unwrap();
    let migrated: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations')::text")
            .fetch_one(&mut db)
            .await
            .unwrap();
    db.close().await.unwrap();
    assert_eq!(migrated, None, "the database was not migrated");
}

#[test]
fn backup_of_a_postgres_store_says_to_use_pg_dump() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        "pg.toml",
        "postgres://fg@127.0.0.1:1/fg",
        "http://127.0.0.1:1",
    );
    let dest = dir.path().join("copy.db");
    let refused = run(&path, &["backup", dest.to_str().unwrap()], &[]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8(refused.stderr).unwrap();
    assert!(
        stderr.contains("pg_dump --format=custom") && stderr.contains("pg_restore"),
        "{stderr}"
    );
    assert!(!dest.exists());
}

/// Sends completions with `key` until `stop`, counting the answers that are 200 and
/// the others.
async fn load(
    url: String,
    key: String,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
) {
    let client = reqwest::Client::new();
    let body = serde_json::json!({"model": "llama-8b", "prompt": "Hi", "max_tokens": 2});
    while !stop.load(Ordering::Relaxed) {
        let response = client
            .post(format!("{url}/v1/completions"))
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await;
        let served = match response {
            Ok(r) if r.status() == 200 => r.bytes().await.is_ok(),
            _ => false,
        };
        let counter = if served { &ok } else { &failed };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Polls `done` every 10 ms for at most 10 s.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < Duration::from_secs(10), "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_taken_while_serving_restores_the_keys_and_usage() {
    let dir = tempfile::tempdir().unwrap();
    let (_mock, upstream) = start_mock(0);
    let database = dir.path().join("fg.db");
    let config = write_config(dir.path(), "fleetgate.toml", &sqlite(&database), &upstream);
    let key = create_key(&config, "alice");
    let (_server, url) = serve(&config, "serve");

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let load = tokio::spawn(load(
        url,
        key.clone(),
        stop.clone(),
        ok.clone(),
        failed.clone(),
    ));
    until("requests served", || ok.load(Ordering::Relaxed) >= 20).await;

    let copy = dir.path().join("copy.db");
    let backup = {
        let (config, copy) = (config.clone(), copy.clone());
        tokio::task::spawn_blocking(move || fleetgate(&config, &["backup", copy.to_str().unwrap()]))
            .await
            .unwrap()
    };
    // The server kept answering, and writing its ledger, while the copy was taken.
    let during = ok.load(Ordering::Relaxed);
    until("requests served after the backup", || {
        ok.load(Ordering::Relaxed) >= during + 20
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    assert_eq!(failed.load(Ordering::Relaxed), 0);

    let said = String::from_utf8(backup.stdout).unwrap();
    assert!(
        said.starts_with(&format!("wrote {}", copy.display())),
        "{said}"
    );
    assert!(said.contains("schema version"), "{said}");
    let rows = |table: &str| -> u64 {
        let line = said
            .lines()
            .find(|l| l.split_whitespace().next() == Some(table))
            .unwrap_or_else(|| panic!("{table} in {said}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert_eq!(rows("api_keys"), 1, "{said}");
    let usage_rows = rows("usage_ledger");
    assert!(usage_rows > 0, "{said}");

    // Not over a file that is there, unless told to.
    let again = run(&config, &["backup", copy.to_str().unwrap()], &[]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let forced = run(&config, &["backup", "--force", copy.to_str().unwrap()], &[]);
    assert!(forced.status.success());
    // Not over the store itself, even told to.
    let onto_itself = run(
        &config,
        &["backup", "--force", database.to_str().unwrap()],
        &[],
    );
    assert!(!onto_itself.status.success());
    let said = String::from_utf8_lossy(&onto_itself.stderr);
    assert!(said.contains("is the store itself"), "{said}");
    assert_eq!(
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| e
                .as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".partial"))
            .count(),
        0,
        "no partial copy left behind"
    );

    // Restored: a server on the copy knows the key and its usage.
    let restored = write_config(dir.path(), "restored.toml", &sqlite(&copy), &upstream);
    let usage = fleetgate(&restored, &["keys", "usage", &key[..12], "--json"]);
    let usage: serde_json::Value = serde_json::from_slice(&usage.stdout).unwrap();
    assert!(usage["used_tokens"].as_u64().unwrap() > 0, "{usage}");
    let (_restored_server, restored_url) = serve(&restored, "restored");
    let response = reqwest::Client::new()
        .post(format!("{restored_url}/v1/completions"))
        .bearer_auth(&key)
        .json(&serde_json::json!({"model": "llama-8b", "prompt": "Hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

/// What a newer release's migration leaves behind: a column the previous binary does not
/// know, and a row in `_sqlx_migrations` for a version it does not have.
const NEWER_RELEASE: [&str; 2] = [
    "ALTER TABLE api_keys ADD COLUMN from_a_newer_release TEXT",
    "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
     VALUES (99990001, 'a newer release', TRUE, $1, 0)",
];

/// Runs [`NEWER_RELEASE`] on the connection `db` (of either backend: a macro, since the
/// two connection types share no trait that binds a value).
macro_rules! as_a_newer_release {
    ($db:ident) => {
        let [column, applied] = NEWER_RELEASE;
        sqlx::query(column).execute(&mut $db).await.unwrap();
        let checksum = vec![0_u8];
        sqlx::query(applied)
            .bind(checksum)
            .execute(&mut $db)
            .await
            .unwrap();
    };
}

/// The previous binary, started again on a database a newer release has migrated (a
/// rollback), opens it and serves its keys.
fn rolls_back(config: &Path, key: &str) {
    let listed = fleetgate(config, &["keys", "list"]);
    let listed = String::from_utf8(listed.stdout).unwrap();
    assert!(listed.contains(&key[..12]), "{listed}");
}

#[tokio::test]
async fn a_database_migrated_by_a_newer_release_still_opens() {
    use sqlx::Connection as _;
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("fg.db");
    let config = write_config(
        dir.path(),
        "fleetgate.toml",
        &sqlite(&database),
        "http://127.0.0.1:1",
    );
    let key = create_key(&config, "alice");
    let url = format!("sqlite://{}", database.display());
    let mut db = sqlx::SqliteConnection::connect(&url).await.unwrap();
    as_a_newer_release!(db);
    db.close().await.unwrap();
    rolls_back(&config, &key);
}

#[tokio::test]
#[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
async fn a_postgres_database_migrated_by_a_newer_release_still_opens() {
    use sqlx::Connection as _;
    let database = common::postgres::FreshDatabase::create("fg_rollback").await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "pg.toml", &database.url, "http://127.0.0.1:1");
    let key = tokio::task::spawn_blocking({
        let config = config.clone();
        move || create_key(&config, "alice")
    })
    .await
    .unwrap();
    let mut db = sqlx::PgConnection::connect(&database.url).await.unwrap();
    as_a_newer_release!(db);
    db.close().await.unwrap();
    tokio::task::spawn_blocking(move || rolls_back(&config, &key))
        .await
        .unwrap();
}
