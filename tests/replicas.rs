//! Several `fleetgate serve` replicas, as real processes, sharing one set of per-key
//! limits (the live counters in Redis, keys and the usage ledger in PostgreSQL); and a
//! gateway riding out a Redis that dies, freezes and comes back.
//!
//! Every test here needs an outside service and is ignored by default; run them with
//! `TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test TEST_REDIS_URL=redis://127.0.0.1:6379 cargo test --test replicas -- --include-ignored`.
//! The replica tests create a database `fg_replicas_<uuid>` and use a Redis key prefix of
//! their own; the Redis-outage tests use SQLite and a private `redis-server` (on PATH)
//! that they kill, pause and restart.
//!
//! Every wait is bounded. A state is awaited by polling `GET /v1/usage` (a real round
//! trip each, a short pause between two), never by sleeping for it to come about. Child
//! processes are killed, databases dropped and Redis keys deleted when a test ends, also
//! when it fails.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

/// The parts of the shared harness (`tests/common`) these tests use.
mod common {
    pub mod forwarder;
    pub mod jobs;
    pub mod postgres;
    pub mod processes;
    pub mod redis_server;
}

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::forwarder::Forwarder;
use common::postgres::FreshDatabase;
use common::processes::{FLEETGATE, MockNode, Proc, serve, signal, start_mock};
use common::redis_server::{RedisServer, free_port};
use sqlx::{AssertSqlSafe, Connection as _, PgConnection};

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::time::timeout;

const REDIS_URL_VAR: &str = "TEST_REDIS_URL";
/// The admin token of every replica's config.
const ADMIN_TOKEN: &str = "replicas-admin-token-0123456789abcdef";
const MODEL: &str = "llama-8b";

/// Upper bound for anything that should happen promptly.
const SOON: Duration = Duration::from_secs(10);
/// The longest one request may take to be answered while Redis is away.
const ANSWER: Duration = Duration::from_secs(5);
/// Pause between two polls of an outside process's state.
const POLL: Duration = Duration::from_millis(20);

// ---------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------

/// Runs a `fleetgate` CLI command against `config`; returns its stdout.
fn fleetgate(config: &Path, args: &[&str]) -> String {
    let output = Command::new(FLEETGATE)
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Creates a key with the given limit flags; returns its secret.
fn create_key(config: &Path, limits: &[&str]) -> String {
    let mut args = vec!["keys", "create", "--name", "replicas"];
    args.extend_from_slice(limits);
    let stdout = fleetgate(config, &args);
    stdout.trim_end().lines().last().unwrap().to_owned()
}

fn write_config(
    dir: &Path,
    database_url: &str,
    redis_url: &str,
    prefix: &str,
    upstreams: &[&str],
) -> PathBuf {
    let path = dir.join("fleetgate.toml");
    let mut config = format!(
        "listen = \"127.0.0.1:0\"\n\
         admin_token = \"{ADMIN_TOKEN}\"\n\
         database_url = \"{database_url}\"\n\
         redis_url = \"{redis_url}\"\n\
         redis_key_prefix = \"{prefix}\"\n\n\
         [[models]]\nid = \"{MODEL}\"\n"
    );
    for (i, upstream) in upstreams.iter().enumerate() {
        config.push_str(&format!(
            "\n[[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"gpu-{i}\"\n"
        ));
    }
    std::fs::write(&path, config).unwrap();
    path
}

/// The key's used tokens this month in the ledger, read through the CLI.
fn ledger_used(config: &Path, key: &str) -> u64 {
    let usage: Value =
        serde_json::from_str(&fleetgate(config, &["keys", "usage", &key[..12], "--json"])).unwrap();
    usage["used_tokens"].as_u64().unwrap()
}

/// Polls the ledger until it holds `tokens` for `key`, for at most `within`.
async fn ledger_reaches(config: &Path, key: &str, tokens: u64, within: Duration) {
    let since = Instant::now();
    loop {
        let used = ledger_used(config, key);
        if used == tokens {
            return;
        }
        assert!(
            since.elapsed() < within,
            "the ledger has {used} tokens, not {tokens}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Makes the database unreachable, as an outage would: every connection to it is
/// ended and it is renamed, so reconnecting fails until [`bring_back`].
async fn take_away(database: &FreshDatabase) {
    let away = format!("{}_away", database.name);
    rename(database, &database.name, &away).await;
}

async fn bring_back(database: &FreshDatabase) {
    let away = format!("{}_away", database.name);
    rename(database, &away, &database.name).await;
}

/// Ends the connections to `from` and renames it; the clients reconnect at once, so
/// this tries until no connection slipped in between (at most 50 times).
async fn rename(database: &FreshDatabase, from: &str, to: &str) {
    let mut admin = PgConnection::connect(&database.admin_url).await.unwrap();
    let mut last = String::new();
    for _ in 0..50 {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(from)
        .execute(&mut admin)
        .await
        .unwrap();
        match sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER DATABASE {from} RENAME TO {to}"
        )))
        .execute(&mut admin)
        .await
        {
            Ok(_) => {
                admin.close().await.unwrap();
                return;
            }
            Err(err) => last = err.to_string(),
        }
    }
    panic!("could not rename {from} to {to}: {last}");
}

/// The Redis-outage tests' setting: one gateway's config over a SQLite store, a Redis
/// on a free port that the test starts (and kills, pauses, restarts) itself, mock-vllm
/// at `token_delay_ms`, and a key with `key_limits`.
struct OneGateway {
    port: u16,
    config: PathBuf,
    api: Api,
    _mock: MockNode,
    _dir: tempfile::TempDir,
}

impl OneGateway {
    fn new(test: &str, token_delay_ms: u64, key_limits: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let (mock, upstream) = start_mock(token_delay_ms);
        let database_url = format!("sqlite://{}/fg.db", dir.path().display());
        let prefix = format!("fleetgate-test:{test}:{}", uuid::Uuid::new_v4().simple());
        let config = write_config(
            dir.path(),
            &database_url,
            &format!("redis://127.0.0.1:{port}"),
            &prefix,
            &[&upstream],
        );
        let api = Api::new(create_key(&config, key_limits));
        Self {
            port,
            config,
            api,
            _mock: mock,
            _dir: dir,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Services
// ---------------------------------------------------------------------------------------

/// A Redis key prefix of one test on the server named by TEST_REDIS_URL; every
/// `{prefix}:*` key is deleted when this is dropped, also on failure.
struct RedisPrefix {
    url: String,
    prefix: String,
}

impl RedisPrefix {
    fn new(test: &str) -> Self {
        let url = std::env::var(REDIS_URL_VAR).unwrap_or_else(|_| {
            panic!(
                "{REDIS_URL_VAR} is not set: the replica tests share their limits through a \
                 Redis server, e.g. {REDIS_URL_VAR}=redis://127.0.0.1:6379"
            )
        });
        let prefix = format!(
            "fleetgate-test:replicas:{test}:{}",
            uuid::Uuid::new_v4().simple()
        );
        Self { url, prefix }
    }

    /// Deletes every key under the prefix; returns how many there were.
    fn delete_keys(url: &str, prefix: &str) -> redis::RedisResult<usize> {
        let client = redis::Client::open(url)?;
        let mut connection = client.get_connection_with_timeout(Duration::from_secs(2))?;
        connection.set_read_timeout(Some(Duration::from_secs(2)))?;
        let keys: Vec<String> =
            redis::Commands::scan_match::<_, String>(&mut connection, format!("{prefix}:*"))?
                .collect::<redis::RedisResult<_>>()?;
        if !keys.is_empty() {
            redis::cmd("DEL").arg(&keys).query::<()>(&mut connection)?;
        }
        Ok(keys.len())
    }
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        if let Err(e) = Self::delete_keys(&self.url, &self.prefix) {
            // Never panic here: this may run while a failed test is already unwinding.
            eprintln!("could not delete the Redis keys {}:*: {e}", self.prefix);
        }
    }
}

/// Two `fleetgate serve` replicas over one PostgreSQL database and one Redis prefix, in
/// front of one mock-vllm, with one key. Fields drop in order: the replicas and the mock
/// are killed first, then the Redis keys are deleted and the database dropped.
struct Cluster {
    replicas: Vec<Proc>,
    _mock: MockNode,
    urls: [String; 2],
    config: PathBuf,
    api: Api,
    _redis: RedisPrefix,
    database: FreshDatabase,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// `token_delay_ms` is mock-vllm's pace, `key_limits` to `fleetgate keys create`.
    async fn start(test: &str, token_delay_ms: u64, key_limits: &[&str]) -> Self {
        let redis = RedisPrefix::new(test);
        let database = FreshDatabase::create("fg_replicas").await;
        let dir = tempfile::tempdir().unwrap();
        let (mock, upstream) = start_mock(token_delay_ms);
        let config = write_config(
            dir.path(),
            &database.url,
            &redis.url,
            &redis.prefix,
            &[&upstream],
        );
        let key = create_key(&config, key_limits);
        let (a, url_a) = serve(&config, "replica A");
        let (b, url_b) = serve(&config, "replica B");
        Self {
            replicas: vec![a, b],
            _mock: mock,
            urls: [url_a, url_b],
            config,
            api: Api::new(key),
            _redis: redis,
            database,
            _dir: dir,
        }
    }
}

// ---------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------

/// Awaits `future`, failing the test if it takes longer than `limit`.
async fn bounded<T>(limit: Duration, what: &str, future: impl Future<Output = T>) -> T {
    timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {limit:?}"))
}

/// One key's calls to any replica.
#[derive(Clone)]
struct Api {
    client: reqwest::Client,
    key: String,
}

impl Api {
    fn new(key: String) -> Self {
        Self {
            client: reqwest::Client::new(),
            key,
        }
    }

    /// `POST /v1/completions`, answered (headers) within `limit`.
    async fn complete_within(&self, limit: Duration, url: &str, body: &Value) -> reqwest::Response {
        let send = self
            .client
            .post(format!("{url}/v1/completions"))
            .bearer_auth(&self.key)
            .json(body)
            .send();
        bounded(limit, "POST /v1/completions answers", send)
            .await
            .unwrap()
    }

    /// `POST /v1/completions` without a bound, for a request expected to wait (the
    /// caller bounds it).
    async fn client_send(&self, url: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{url}/v1/completions"))
            .bearer_auth(&self.key)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// A stream that has started: 200, and its first frame read.
    async fn start_stream(&self, url: &str, body: &Value) -> reqwest::Response {
        let mut response = self.complete_within(SOON, url, body).await;
        assert_eq!(response.status(), 200, "the stream starts");
        first_frame(&mut response).await;
        response
    }

    /// `GET /v1/usage`, answered within `limit`.
    async fn usage_response(&self, limit: Duration, url: &str) -> reqwest::Response {
        let send = self
            .client
            .get(format!("{url}/v1/usage"))
            .bearer_auth(&self.key)
            .send();
        bounded(limit, "GET /v1/usage answers", send).await.unwrap()
    }

    /// The key's live counters as `url` reports them.
    async fn usage(&self, url: &str) -> Value {
        let response = self.usage_response(SOON, url).await;
        assert_eq!(response.status(), 200, "GET /v1/usage");
        response.json().await.unwrap()
    }

    /// Polls `GET /v1/usage` on `url` until `pred` holds; returns that reading.
    async fn wait_usage(&self, url: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let mut last = Value::Null;
        let found = timeout(SOON, async {
            loop {
                last = self.usage(url).await;
                if pred(&last) {
                    return last.clone();
                }
                tokio::time::sleep(POLL).await;
            }
        })
        .await;
        found.unwrap_or_else(|_| panic!("{url}: {what}: not within {SOON:?}; last {last}"))
    }
}

/// Polls until the key has `running` and `queued` requests, as `url` sees them.
async fn wait_occupancy(api: &Api, url: &str, running: u64, queued: u64) -> Value {
    api.wait_usage(url, &format!("running {running}, queued {queued}"), |u| {
        u["running"] == running && u["queued"] == queued
    })
    .await
}

/// Reads the next chunk of a stream (at least one SSE frame has begun).
async fn first_frame(response: &mut reqwest::Response) -> Bytes {
    bounded(SOON, "a stream frame arrives", response.chunk())
        .await
        .unwrap()
        .expect("a frame, not the end of the stream")
}

/// The error envelope of a refusal, checking its status, code and `Retry-After`.
async fn refusal(response: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(response.status(), status, "{code}");
    let retry_after = response
        .headers()
        .get("retry-after")
        .unwrap_or_else(|| panic!("{code} carries Retry-After"))
        .to_str()
        .unwrap()
        .parse::<u64>()
        .unwrap();
    assert!(retry_after >= 1, "{code}: Retry-After {retry_after}");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], code, "{body}");
    body
}

/// `requested=N,applied=M,reason=…,source=…` of `X-Acs-Max-Tokens-Clamped`.
fn parse_clamp(value: &str) -> (u64, u64, String, String) {
    let field = |name: &str| {
        value
            .split(',')
            .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("{name} in the clamp header {value:?}"))
            .to_owned()
    };
    (
        field("requested").parse().unwrap(),
        field("applied").parse().unwrap(),
        field("reason"),
        field("source"),
    )
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

/// A key changed from outside (the CLI, over the shared PostgreSQL database) reaches
/// both replicas' key tables within 1 s: a budget cut to one token refuses the next
/// request on each, a revocation answers 401 on each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn key_changes_reach_both_replicas_within_a_second() {
    let cluster = Cluster::start("keyfeed", 0, &[]).await;
    let api = &cluster.api;
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2});
    for url in &cluster.urls {
        assert_eq!(api.complete_within(ANSWER, url, &body).await.status(), 200);
    }
    let prefix = &api.key[..12];
    for (change, status) in [
        (&["keys", "set", prefix, "--monthly-budget", "1"][..], 429),
        (&["keys", "revoke", prefix][..], 401),
    ] {
        fleetgate(&cluster.config, change);
        let changed = Instant::now();
        for url in &cluster.urls {
            loop {
                let answer = api.complete_within(ANSWER, url, &body).await.status();
                if answer == status {
                    break;
                }
                assert!(
                    changed.elapsed() < Duration::from_secs(1),
                    "{change:?}: {url} still answers {answer} after 1 s"
                );
                tokio::time::sleep(POLL).await;
            }
        }
    }
}

/// A key rotated through replica A's admin API with a grace of 3 s: within 1 s both
/// replicas have the rotation (through the change feed: the new secret works on B, and
/// B's `/v1/usage` names the grace's end); the old secret keeps working on both until
/// the grace ends, and from then on only the new one does, on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn a_rotated_keys_old_and_new_secrets_both_work_until_the_grace_ends_on_both_replicas() {
    let cluster = Cluster::start("rotation", 0, &[]).await;
    let old = &cluster.api;
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2});
    for url in &cluster.urls {
        assert_eq!(old.complete_within(ANSWER, url, &body).await.status(), 200);
    }

    let rotate = old
        .client
        .post(format!(
            "{}/admin/keys/{}/rotate",
            cluster.urls[0],
            &old.key[..12]
        ))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"grace_seconds": 3}))
        .send();
    let rotated = bounded(SOON, "the rotation answers", rotate).await.unwrap();
    let rotated_at = Instant::now();
    assert_eq!(rotated.status(), 200);
    let rotated: Value = rotated.json().await.unwrap();
    let grace_end = rotated["previous_secret_expires_at"].as_i64().unwrap();
    let new = Api::new(rotated["secret"].as_str().unwrap().to_owned());
    assert_eq!(&new.key[..12], &old.key[..12], "the same key");

    // Both replicas have the rotation within 1 s.
    for url in &cluster.urls {
        loop {
            let answer = new.complete_within(ANSWER, url, &body).await.status();
            let usage = old.usage(url).await;
            if answer == 200 && usage["previous_secret_expires_at"] == grace_end {
                break;
            }
            assert!(
                rotated_at.elapsed() < Duration::from_secs(1),
                "{url}: the new secret answers {answer}, the grace is {} after 1 s",
                usage["previous_secret_expires_at"]
            );
            tokio::time::sleep(POLL).await;
        }
    }

    // Until the grace ends both secrets work on both replicas; from then on only the
    // new one. Each answer is checked against the second it was given in.
    let mut refused_on = [false; 2];
    while refused_on != [true; 2] {
        for (i, url) in cluster.urls.iter().enumerate() {
            let before = fleetgate::store::now_unix();
            let answer = old.complete_within(ANSWER, url, &body).await;
            let after = fleetgate::store::now_unix();
            match answer.status().as_u16() {
                200 => {
                    assert!(
                        before < grace_end,
                        "{url}: the old secret works after the grace"
                    );
                    answer.bytes().await.unwrap();
                }
                401 => {
                    assert!(
                        after >= grace_end,
                        "{url}: the old secret refused in its grace"
                    );
                    let refusal: Value = answer.json().await.unwrap();
                    assert!(
                        refusal["error"]["message"]
                            .as_str()
                            .unwrap()
                            .starts_with("This secret was replaced by a new one"),
                        "{refusal}"
                    );
                    refused_on[i] = true;
                }
                other => panic!("{url}: the old secret answers {other}"),
            }
            let answer = new.complete_within(ANSWER, url, &body).await.status();
            assert_eq!(answer, 200, "{url}: the new secret");
        }
        assert!(
            rotated_at.elapsed() < Duration::from_secs(6),
            "the old secret still works after the grace: refused on {refused_on:?}"
        );
        tokio::time::sleep(POLL).await;
    }
    for url in &cluster.urls {
        assert_eq!(
            new.usage(url).await["previous_secret_expires_at"],
            Value::Null
        );
    }
}

/// PostgreSQL unreachable under load (connections ended, database renamed): both
/// replicas keep serving the key they hold in memory — never a 500 — while its usage
/// waits in their write-behind writers; a key they do not hold is 503
/// `store_unavailable` with `Retry-After`. Once the database is back, the ledger, the
/// live counters and what the clients were told agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn a_postgres_outage_stops_no_traffic_and_loses_no_usage() {
    // Requests back to back for 2 s: the default rate limit (600 a minute, in bursts of
    // as many) is not what this test is about.
    let cluster = Cluster::start("pgout", 0, &["--rpm", "1000000"]).await;
    let api = &cluster.api;
    let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2});
    let mut told = 0;
    let mut complete = async |url: &str| {
        let response = api.complete_within(ANSWER, url, &body).await;
        assert_eq!(response.status(), 200, "{url}");
        let json: Value = response.json().await.unwrap();
        told += json["usage"]["total_tokens"].as_u64().unwrap();
    };
    for url in &cluster.urls {
        complete(url).await;
    }

    take_away(&cluster.database).await;
    let away = Instant::now();
    let mut served = 0;
    while away.elapsed() < Duration::from_secs(2) {
        for url in &cluster.urls {
            complete(url).await;
            served += 1;
        }
    }
    let stranger = Api::new(format!(
        "{}{}",
        &api.key[..3],
        "A".repeat(api.key.len() - 3)
    ));
    let refused = stranger
        .complete_within(ANSWER, &cluster.urls[0], &body)
        .await;
    assert_eq!(refused.headers()["retry-after"], "1");
    refusal(refused, 503, "store_unavailable").await;
    bring_back(&cluster.database).await;
    eprintln!("{served} requests served while PostgreSQL was away");

    for url in &cluster.urls {
        let usage = api
            .wait_usage(url, "all settled", |u| {
                u["running"] == 0 && u["reserved"] == 0
            })
            .await;
        assert_eq!(usage["used"], told, "{url}: {usage}");
    }
    ledger_reaches(&cluster.config, &api.key, told, SOON).await;
}

/// A replica killed (SIGKILL) before its write-behind writer could commit what it
/// served (PostgreSQL is away, so the rows wait in its memory): the counters in Redis
/// charged them, and Redis journaled them as it did; once the replica's heartbeat has
/// lapsed the survivor adopts its journal, and the ledger gets every token the clients
/// were told of, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn a_replica_killed_before_its_writer_commits_loses_no_usage() {
    let mut cluster = Cluster::start("adopt", 0, &[]).await;
    let api = cluster.api.clone();
    let [a, b] = cluster.urls.clone();
    let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2});
    let mut told = 0;
    // Both replicas are up (they print their address before they have read the keys).
    for url in [&a, &b] {
        let response = api.complete_within(ANSWER, url, &body).await;
        let json: Value = response.json().await.unwrap();
        told += json["usage"]["total_tokens"].as_u64().unwrap();
    }
    take_away(&cluster.database).await;
    for _ in 0..20 {
        let response = api.complete_within(ANSWER, &a, &body).await;
        assert_eq!(response.status(), 200);
        let json: Value = response.json().await.unwrap();
        told += json["usage"]["total_tokens"].as_u64().unwrap();
    }
    cluster.replicas[0].0.kill().unwrap();
    let killed = Instant::now();
    bring_back(&cluster.database).await;
    let usage = api
        .wait_usage(&b, "the live counter has it all", |u| u["used"] == told)
        .await;
    assert_eq!(usage["reserved"], 0, "{usage}");
    // The heartbeat lapses within 10 s, the survivor looks every 5 s.
    let within = Duration::from_secs(25);
    ledger_reaches(&cluster.config, &api.key, told, within).await;
    eprintln!(
        "the ledger had every row {:?} after the kill",
        killed.elapsed()
    );
}

/// A replica killed (SIGKILL) while it holds the key's one slot and the head of its
/// queue: the slot and the queue place lapse within seconds, so a request waiting
/// behind them on the surviving replica starts within 3 s of the kill, not 30.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn a_dead_replicas_slot_and_queue_places_free_within_seconds() {
    let mut cluster = Cluster::start(
        "deadplaces",
        50,
        &["--max-concurrent", "1", "--max-queued", "4"],
    )
    .await;
    let [a, b] = cluster.urls.clone();
    let api = cluster.api.clone();
    let slow = slow_stream();
    let quick = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2});
    let _holding = api.start_stream(&a, &slow).await;
    // The head of the queue waits on A, and dies with it (its error is expected).
    let head = {
        let (api, a, quick) = (api.clone(), a.clone(), quick.clone());
        tokio::spawn(async move {
            let _ = api
                .client
                .post(format!("{a}/v1/completions"))
                .bearer_auth(&api.key)
                .json(&quick)
                .send()
                .await;
        })
    };
    wait_occupancy(&api, &b, 1, 1).await;
    let behind = {
        let (api, b, quick) = (api.clone(), b.clone(), quick.clone());
        tokio::spawn(async move { api.client_send(&b, &quick).await })
    };
    wait_occupancy(&api, &b, 1, 2).await;

    cluster.replicas[0].0.kill().unwrap();
    let killed = Instant::now();
    let served = bounded(SOON, "the waiter on the surviving replica", behind)
        .await
        .unwrap();
    let waited = killed.elapsed();
    assert_eq!(served.status(), 200);
    assert!(
        waited < Duration::from_secs(3),
        "started {waited:?} after the kill"
    );
    eprintln!("the surviving waiter started {waited:?} after the kill");
    head.abort();
}

/// A stream of 2000 tokens: at a cluster's 50 ms a token it would run 100 s, so a test
/// ends it (by dropping the response).
fn slow_stream() -> Value {
    json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "stream": true})
}

/// Two replicas hold one queue: two streams running through A fill the key's slots, a
/// third through B waits (both replicas see running 2, queued 1), a fourth through either
/// is refused `queue_full`; when the first stream ends, B's waiter starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn two_replicas_share_one_queue() {
    let cluster =
        Cluster::start("queue", 50, &["--max-concurrent", "2", "--max-queued", "1"]).await;
    let [a, b] = &cluster.urls;
    let api = &cluster.api;
    let slow = slow_stream();

    let first = api.start_stream(a, &slow).await;
    let mut second = api.start_stream(a, &slow).await;
    wait_occupancy(api, b, 2, 0).await;

    let third = {
        let (api, b, slow) = (api.clone(), b.clone(), slow.clone());
        tokio::spawn(async move { api.client_send(&b, &slow).await })
    };
    for url in [a, b] {
        wait_occupancy(api, url, 2, 1).await;
    }
    assert!(!third.is_finished(), "the third request waits");

    for url in [a, b] {
        let response = api.complete_within(SOON, url, &slow).await;
        let body = refusal(response, 429, "queue_full").await;
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("2 requests running and 1 waiting"),
            "{message}"
        );
    }
    for url in [a, b] {
        wait_occupancy(api, url, 2, 1).await;
    }
    assert!(!third.is_finished(), "the refusals did not take its place");

    // The first stream ends (the client goes away): A releases its slot and B's waiter
    // takes it.
    drop(first);
    let mut third = bounded(SOON, "the waiting request starts", third)
        .await
        .unwrap();
    assert_eq!(third.status(), 200);
    first_frame(&mut third).await;
    first_frame(&mut second).await;
    for url in [a, b] {
        wait_occupancy(api, url, 2, 0).await;
    }

    drop(second);
    drop(third);
    for url in [a, b] {
        let usage = api
            .wait_usage(url, "all slots free, nothing reserved", |u| {
                u["running"] == 0 && u["queued"] == 0 && u["reserved"] == 0
            })
            .await;
        assert!(usage["used"].as_u64().unwrap() > 0, "{usage}");
    }
}

/// A stream that runs for three of the limiter's lease TTLs (2 s each) keeps its slot
/// on every replica, because the gateway renews its lease while it runs: with one slot
/// and no queue, a request through the other replica is refused `queue_full` then just
/// as at the start, and let through once the stream has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn a_long_stream_keeps_its_slot_on_every_replica() {
    const LEASE_TTL: Duration = Duration::from_secs(2);
    let cluster =
        Cluster::start("renew", 50, &["--max-concurrent", "1", "--max-queued", "0"]).await;
    let [a, b] = &cluster.urls;
    let api = &cluster.api;
    let slow = slow_stream();
    let short = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 1});

    let mut stream = api.start_stream(a, &slow).await;
    let started = std::time::Instant::now();
    while started.elapsed() < LEASE_TTL * 3 {
        first_frame(&mut stream).await;
    }
    wait_occupancy(api, b, 1, 0).await;
    let refused = api.complete_within(SOON, b, &short).await;
    refusal(refused, 429, "queue_full").await;
    first_frame(&mut stream).await;

    drop(stream);
    wait_occupancy(api, b, 0, 0).await;
    let response = api.complete_within(SOON, b, &short).await;
    assert_eq!(
        response.status(),
        200,
        "the slot is free once the stream ended"
    );
}

/// Two replicas hold one budget: 16 concurrent requests, 8 through each, each worth 108
/// tokens at most (8 prompt ids + 100), against a budget of 1000. What is charged never
/// exceeds the budget; the request that no longer fits whole is clamped (and says so),
/// the rest are refused `budget_exceeded`; live counters on both replicas and the ledger
/// agree with the responses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn two_replicas_share_one_budget() {
    const BUDGET: u64 = 1000;
    const PROMPT: u64 = 8;
    const MAX_TOKENS: u64 = 100;
    const REQUESTS: usize = 16;
    let budget = BUDGET.to_string();
    // 100 tokens 2 ms apart: each request runs ~200 ms, so they overlap.
    let cluster = Cluster::start("budget", 2, &["--monthly-budget", &budget]).await;
    let api = &cluster.api;
    let prompt: Vec<u64> = (1..=PROMPT).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS});

    let requests = (0..REQUESTS).map(|i| {
        let (api, url, body) = (api.clone(), cluster.urls[i % 2].clone(), body.clone());
        tokio::spawn(async move {
            let response = api.complete_within(SOON, &url, &body).await;
            let clamp = response
                .headers()
                .get("x-acs-max-tokens-clamped")
                .map(|v| v.to_str().unwrap().to_owned());
            let status = response.status().as_u16();
            let retry_after = response.headers().contains_key("retry-after");
            let json: Value = response.json().await.unwrap();
            (status, clamp, retry_after, json)
        })
    });
    let outcomes = bounded(
        3 * SOON,
        "all requests answered",
        futures_util::future::join_all(requests),
    )
    .await;

    let (mut full, mut clamped, mut refused, mut charged) = (0, 0, 0, 0);
    for outcome in outcomes {
        let (status, clamp, retry_after, json) = outcome.unwrap();
        match status {
            200 => {
                let usage = &json["usage"];
                let completion = usage["completion_tokens"].as_u64().unwrap();
                assert_eq!(usage["prompt_tokens"], PROMPT, "{json}");
                assert_eq!(usage["total_tokens"], PROMPT + completion, "{json}");
                charged += PROMPT + completion;
                match clamp {
                    Some(header) => {
                        let (requested, applied, reason, source) = parse_clamp(&header);
                        assert_eq!(requested, MAX_TOKENS, "{header}");
                        assert_eq!(applied, completion, "applied = generated: {header}");
                        assert!(applied < MAX_TOKENS, "{header}");
                        assert_eq!((reason.as_str(), source.as_str()), ("budget", "client"));
                        clamped += 1;
                    }
                    None => {
                        assert_eq!(completion, MAX_TOKENS, "unclamped runs whole: {json}");
                        full += 1;
                    }
                }
            }
            429 => {
                assert_eq!(json["error"]["code"], "budget_exceeded", "{json}");
                assert!(retry_after, "budget_exceeded carries Retry-After");
                assert!(clamp.is_none());
                refused += 1;
            }
            other => panic!("unexpected {other}: {json}"),
        }
    }
    eprintln!("{full} whole, {clamped} clamped, {refused} refused; {charged} tokens charged");
    assert!(charged <= BUDGET, "charged {charged} > budget {BUDGET}");
    // Each admitted request uses its whole reservation (the mock never stops early), so
    // however they interleave: 9 × 108 = 972 whole, one clamped to the 28 left
    // (8 + 20), the other six refused, and the budget used exactly.
    assert_eq!((full, clamped, refused), (9, 1, 6));
    assert_eq!(charged, BUDGET);

    // Both replicas read the same counters, and they match the responses.
    for url in &cluster.urls {
        let usage = api
            .wait_usage(url, "all settled", |u| {
                u["running"] == 0 && u["reserved"] == 0
            })
            .await;
        assert_eq!(usage["used"], charged, "{url}: {usage}");
        assert_eq!(usage["remaining"], BUDGET - charged, "{url}: {usage}");
    }
    // So does the ledger in PostgreSQL, once the write-behind writers have committed
    // (within milliseconds).
    ledger_reaches(&cluster.config, &api.key, charged, Duration::from_secs(1)).await;
    // And the next request is refused by either replica.
    for url in &cluster.urls {
        let response = api.complete_within(SOON, url, &body).await;
        refusal(response, 429, "budget_exceeded").await;
    }
}

/// Polls `POST /v1/completions` until it is admitted again after Redis came back (each
/// attempt answered within [`ANSWER`]; until then only `admission_unavailable`); returns
/// the tokens charged and the number of attempts.
async fn until_admitted(api: &Api, url: &str, body: &Value) -> (u64, u32) {
    let mut attempts = 0;
    bounded(SOON, "admitted again after Redis came back", async {
        loop {
            attempts += 1;
            let response = api.complete_within(ANSWER, url, body).await;
            if response.status() == 200 {
                let json: Value = response.json().await.unwrap();
                return (json["usage"]["total_tokens"].as_u64().unwrap(), attempts);
            }
            refusal(response, 503, "admission_unavailable").await;
            tokio::time::sleep(POLL).await;
        }
    })
    .await
}

/// Every call that needs the counters answers promptly with 503 `admission_unavailable`
/// (and `Retry-After`); `/health` still answers 200.
async fn expect_admission_unavailable(api: &Api, url: &str, body: &Value) {
    for _ in 0..3 {
        let started = Instant::now();
        let response = api.complete_within(ANSWER, url, body).await;
        refusal(response, 503, "admission_unavailable").await;
        eprintln!("refused in {:?}", started.elapsed());
    }
    let usage = api.usage_response(ANSWER, url).await;
    refusal(usage, 503, "admission_unavailable").await;
    let health = bounded(
        ANSWER,
        "GET /health answers",
        api.client.get(format!("{url}/health")).send(),
    )
    .await
    .unwrap();
    assert_eq!(health.status(), 200, "/health does not depend on Redis");
}

/// The total of the usage-only frame of an SSE body.
fn stream_usage(body: &str) -> u64 {
    body.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str::<Value>(data).unwrap())
        .find_map(|frame| frame["usage"]["total_tokens"].as_u64())
        .unwrap_or_else(|| panic!("a usage frame in {body}"))
}

/// A Redis Cluster node is refused at start, saying why and what to do instead; nothing
/// is served from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH"]
async fn a_redis_cluster_node_is_refused_at_start() {
    let setup = OneGateway::new("cluster", 0, &[]);
    let nodes = setup._dir.path().join("nodes.conf");
    let bus = free_port().to_string();
    let _redis = RedisServer::start_with(
        setup.port,
        &[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            nodes.to_str().unwrap(),
            "--cluster-port",
            &bus,
        ],
        &format!("redis://127.0.0.1:{}", setup.port),
    )
    .await;
    let mut child = Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(&setup.config)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = bounded(SOON, "serve exits", async {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(POLL).await;
        }
    })
    .await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("names a node of a Redis Cluster"),
        "{stderr}"
    );
    assert!(stderr.contains("Point it at one primary"), "{stderr}");
}

/// One gateway and a private Redis that is missing at start, then killed (SIGKILL) under
/// load and started again, empty. While it is away every admission answers 503
/// `admission_unavailable` with `Retry-After` within a bound, a queued request is told
/// too, a running stream still finishes, and `/health` answers; once it is back,
/// requests are admitted again and the used counter is rebuilt from the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH"]
async fn a_gateway_rides_out_redis_going_away() {
    let setup = OneGateway::new(
        "restart",
        20,
        &["--max-concurrent", "1", "--max-queued", "1"],
    );
    let (port, config, api) = (setup.port, &setup.config, setup.api.clone());
    let quick = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2});

    // The gateway starts while Redis is down, and refuses what needs the counters.
    let (_gateway, url) = serve(config, "gateway");
    expect_admission_unavailable(&api, &url, &quick).await;

    let mut redis = RedisServer::start(port).await;
    let (mut charged, attempts) = until_admitted(&api, &url, &quick).await;
    eprintln!("admitted after Redis started: attempt {attempts}");

    // A stream runs (the key's one slot) and a request waits behind it when Redis dies.
    // The stream: 300 tokens 20 ms apart (~6 s).
    let long = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 300, "stream": true,
        "stream_options": {"include_usage": true}});
    let mut running = api.start_stream(&url, &long).await;
    let waiting = {
        let (api, url, quick) = (api.clone(), url.clone(), quick.clone());
        tokio::spawn(async move { api.client_send(&url, &quick).await })
    };
    wait_occupancy(&api, &url, 1, 1).await;

    redis.kill();
    let killed = Instant::now();
    let waiting = bounded(ANSWER, "the waiting request is answered", waiting)
        .await
        .unwrap();
    refusal(waiting, 503, "admission_unavailable").await;
    eprintln!(
        "the waiter was refused {:?} after the kill",
        killed.elapsed()
    );
    expect_admission_unavailable(&api, &url, &quick).await;

    // The running stream goes on to its end; settling it cannot reach Redis, which
    // delays the end of the body by a bounded time only.
    let body = bounded(3 * SOON, "the running stream ends", async {
        let mut body = Vec::new();
        while let Some(chunk) = running.chunk().await.unwrap() {
            body.extend_from_slice(&chunk);
        }
        String::from_utf8(body).unwrap()
    })
    .await;
    let streamed = stream_usage(&body);
    assert_eq!(streamed, 4 + 300);
    charged += streamed;

    // Redis comes back empty: requests are admitted again, and the used counter is
    // rebuilt from the ledger (which has the stream that ended while Redis was away).
    let _redis = RedisServer::start(port).await;
    let (tokens, attempts) = until_admitted(&api, &url, &quick).await;
    eprintln!("admitted after Redis restarted: attempt {attempts}");
    charged += tokens;
    for _ in 0..3 {
        let response = api.complete_within(ANSWER, &url, &quick).await;
        assert_eq!(response.status(), 200);
        let json: Value = response.json().await.unwrap();
        charged += json["usage"]["total_tokens"].as_u64().unwrap();
    }
    let usage = api
        .wait_usage(&url, "all settled", |u| {
            u["running"] == 0 && u["queued"] == 0
        })
        .await;
    assert_eq!(usage["used"], charged, "{usage}");
    assert_eq!(usage["reserved"], 0, "{usage}");
}

/// A Redis that freezes (SIGSTOP) rather than dies: admissions time out and answer 503
/// `admission_unavailable` within a bound. Once it resumes, Redis runs the admission
/// script whose reply timed out, giving a running slot to a request already refused;
/// the gateway gives such slots back, so the next request is admitted at once instead
/// of queueing behind a phantom until its lease lapses (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH"]
async fn a_frozen_redis_leaves_no_phantom_slots() {
    let setup = OneGateway::new("freeze", 0, &["--max-concurrent", "1"]);
    let (port, config, api) = (setup.port, &setup.config, setup.api.clone());
    let quick = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2});
    let redis = RedisServer::start(port).await;
    let (_gateway, url) = serve(config, "gateway");
    until_admitted(&api, &url, &quick).await;

    signal(&redis.0, "STOP");
    expect_admission_unavailable(&api, &url, &quick).await;
    signal(&redis.0, "CONT");

    let resumed = Instant::now();
    let (_, attempts) = until_admitted(&api, &url, &quick).await;
    eprintln!(
        "admitted {:?} after Redis resumed (attempt {attempts})",
        resumed.elapsed()
    );
    let usage = api
        .wait_usage(&url, "no phantom slot or queue place", |u| {
            u["running"] == 0 && u["queued"] == 0 && u["reserved"] == 0
        })
        .await;
    assert_eq!(usage["used"], 2 * (4 + 2), "{usage}");
}

/// A client that goes away while its admission is on its way to Redis leaves nothing
/// behind: Redis runs the admission script all the same (here once it resumes from a
/// freeze) and gives the gone request a running slot and a reservation, which the
/// gateway gives back at once — not when the lease lapses, and not with its reservation
/// counted against the budget for two minutes after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH"]
async fn a_client_gone_during_its_admission_leaves_no_slot_or_reservation() {
    let setup = OneGateway::new("gone", 0, &["--max-concurrent", "1"]);
    let (port, config, api) = (setup.port, &setup.config, setup.api.clone());
    let quick = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2});
    let redis = RedisServer::start(port).await;
    let (_gateway, url) = serve(config, "gateway");
    let (charged, _) = until_admitted(&api, &url, &quick).await;

    signal(&redis.0, "STOP");
    // The client gives up well before the gateway's own bound on the call (500 ms), so
    // the request is dropped while it waits for Redis's answer.
    let gone = api
        .client
        .post(format!("{url}/v1/completions"))
        .bearer_auth(&api.key)
        .json(&quick)
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(gone.is_err_and(|e| e.is_timeout()), "the client gave up");
    signal(&redis.0, "CONT");

    let usage = api
        .wait_usage(
            &url,
            "the gone request's slot and reservation given back",
            |u| u["running"] == 0 && u["queued"] == 0 && u["reserved"] == 0,
        )
        .await;
    assert_eq!(usage["used"], charged, "{usage}");
    let after = api.complete_within(ANSWER, &url, &quick).await;
    assert_eq!(after.status(), 200, "the key's one slot is free");
}

/// Requests that end while Redis is frozen (SIGSTOP) cannot settle their live counters
/// then; their settlements are retried until Redis confirms them, so once it resumes the
/// key's `used` counter, the ledger and what the clients were told all agree, and no
/// slot or reservation is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH"]
async fn settlements_during_a_redis_freeze_are_not_lost() {
    let setup = OneGateway::new("settle", 20, &["--max-concurrent", "4"]);
    let (port, config, api) = (setup.port, &setup.config, setup.api.clone());
    let redis = RedisServer::start(port).await;
    let (_gateway, url) = serve(config, "gateway");
    let quick = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2});
    let (mut told, _) = until_admitted(&api, &url, &quick).await;

    // Four streams of 20 to 80 tokens 20 ms apart (0.4 to 1.6 s) are running when Redis
    // freezes for longer than that: each ends, and settles, while Redis cannot answer —
    // the later ones after earlier calls have timed out and the connection was dropped.
    let mut running = Vec::new();
    for max_tokens in [20, 40, 60, 80] {
        let stream = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens,
            "stream": true, "stream_options": {"include_usage": true}});
        running.push(api.start_stream(&url, &stream).await);
    }
    signal(&redis.0, "STOP");
    let frozen = Instant::now();
    for mut response in running {
        let body = bounded(SOON, "a stream ends while Redis is frozen", async {
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.unwrap() {
                body.extend_from_slice(&chunk);
            }
            String::from_utf8(body).unwrap()
        })
        .await;
        told += stream_usage(&body);
    }
    // Frozen for 3 s in all, past every stream's end and call time-out.
    let rest = Duration::from_secs(3).saturating_sub(frozen.elapsed());
    tokio::time::sleep(rest).await;
    signal(&redis.0, "CONT");

    let usage = api
        .wait_usage(&url, "the retried settlements applied", |u| {
            u["running"] == 0 && u["reserved"] == 0 && u["used"] == told
        })
        .await;
    assert_eq!(usage["used"], told, "{usage}");
    assert_eq!(ledger_used(config, &api.key), told);
}

// ---------------------------------------------------------------------------------------
// Chaos: three replicas under load through every fault in turn
// ---------------------------------------------------------------------------------------

/// The key with a budget in the chaos test: it runs out part-way through the faults.
const CHAOS_BUDGET: u64 = 3_000;
/// A request taking longer than this counts as hung: the longest documented wait is an
/// admission call to a Redis that does not answer (2 s), then the request itself.
const HUNG: Duration = Duration::from_secs(10);
/// The surviving replicas serve again within this of each fault's end.
const RECOVERY: Duration = Duration::from_secs(3);

/// How one chaos request ended.
#[derive(Debug)]
struct Outcome {
    key: &'static str,
    replica: usize,
    started: Instant,
    ended: Instant,
    /// `None`: the connection failed (its replica was killed).
    status: Option<u16>,
    code: String,
    /// `usage.total_tokens` of a 200.
    told: u64,
    /// The most the request could be charged (prompt + `max_tokens`).
    worst: u64,
}

/// A fault: when it began and when the service it took away was back.
struct Fault {
    name: &'static str,
    began: Instant,
    over: Instant,
    /// The replica it killed, whose own clients are not expected to be served.
    victim: Option<usize>,
}

type Replicas = Arc<Mutex<Vec<Option<String>>>>;

/// One client of `key` on replica `replica`: sends requests one after another (every
/// `pace`, if set) until `stop`; returns how each ended.
async fn chaos_client(
    api: Api,
    key: &'static str,
    replica: usize,
    urls: Replicas,
    pace: Option<Duration>,
    stop: Arc<AtomicBool>,
) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let url = urls.lock().unwrap()[replica].clone();
        let Some(url) = url else {
            // The replica is down: wait for its restart.
            tokio::time::sleep(POLL).await;
            continue;
        };
        i += 1;
        let max_tokens = 4 + i % 13;
        let body = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens});
        let started = Instant::now();
        let sent = async {
            let response = api
                .client
                .post(format!("{url}/v1/completions"))
                .bearer_auth(&api.key)
                .json(&body)
                .send()
                .await?;
            let status = response.status().as_u16();
            let json: Value = response.json().await?;
            Ok::<_, reqwest::Error>((status, json))
        };
        let answered = timeout(HUNG, sent).await;
        let ended = Instant::now();
        let (status, code, told) = match answered {
            Err(_) => panic!("{key} on replica {replica}: no answer within {HUNG:?}"),
            Ok(Err(_)) => (None, String::new(), 0),
            Ok(Ok((status, json))) => {
                let code = json["error"]["code"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let told = json["usage"]["total_tokens"].as_u64().unwrap_or(0);
                assert!(status != 200 || told > 0, "{json}");
                (Some(status), code, told)
            }
        };
        outcomes.push(Outcome {
            key,
            replica,
            started,
            ended,
            status,
            code,
            told,
            worst: 4 + max_tokens,
        });
        if let Some(pace) = pace {
            tokio::time::sleep(pace.saturating_sub(started.elapsed())).await;
        }
    }
    outcomes
}

/// Three replicas sharing one PostgreSQL database and one (private) Redis, two upstream
/// nodes, two keys — one without a budget to speak of, one whose budget runs out
/// part-way — and nine clients, under load through: Redis frozen and resumed, Redis
/// killed and restarted empty, PostgreSQL unreachable and back, one replica SIGKILLed
/// and restarted, one upstream node killed. Asserts that only documented statuses were
/// answered (a connection error only to the killed replica's clients), that no request
/// hung, that the surviving replicas served again within 3 s of each fault, that the
/// budget was not overshot by one token, and that once everything settled the ledger,
/// the live counters and what the clients were told agree for both keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and redis-server on PATH (set TEST_POSTGRES_URL)"]
async fn three_replicas_ride_out_every_fault_with_exact_budgets() {
    let database = FreshDatabase::create("fg_chaos").await;
    let dir = tempfile::tempdir().unwrap();
    let redis_port = free_port();
    let mut redis = RedisServer::start(redis_port).await;
    let (node_a, upstream_a) = start_mock(2);
    let (node_b, upstream_b) = start_mock(2);
    let prefix = format!("fleetgate-test:chaos:{}", uuid::Uuid::new_v4().simple());
    let config = write_config(
        dir.path(),
        &database.url,
        &format!("redis://127.0.0.1:{redis_port}"),
        &prefix,
        &[&upstream_a, &upstream_b],
    );
    let (metered, budgeted) = chaos_keys(&config);
    let (mut replicas, urls) = serve_replicas(&config, 3);
    let stop = Arc::new(AtomicBool::new(false));
    let clients = spawn_chaos_clients(&metered, &budgeted, &urls, &stop);

    // The schedule: each fault held for a few seconds, with healthy load between two.
    let calm = Duration::from_secs(3);
    let mut faults = Vec::new();
    tokio::time::sleep(calm).await;

    let began = Instant::now();
    signal(&redis.0, "STOP");
    tokio::time::sleep(Duration::from_secs(4)).await;
    signal(&redis.0, "CONT");
    faults.push(Fault {
        name: "Redis frozen 4 s",
        began,
        over: Instant::now(),
        victim: None,
    });
    tokio::time::sleep(calm).await;

    let began = Instant::now();
    redis.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    redis = RedisServer::start(redis_port).await;
    faults.push(Fault {
        name: "Redis killed, restarted empty",
        began,
        over: Instant::now(),
        victim: None,
    });
    tokio::time::sleep(calm).await;

    let began = Instant::now();
    take_away(&database).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    bring_back(&database).await;
    faults.push(Fault {
        name: "PostgreSQL unreachable 4 s",
        began,
        over: Instant::now(),
        victim: None,
    });
    tokio::time::sleep(calm).await;

    let began = Instant::now();
    urls.lock().unwrap()[2] = None;
    replicas[2].0.kill().unwrap();
    replicas[2].0.wait().unwrap();
    faults.push(Fault {
        name: "replica 2 SIGKILLed",
        began,
        over: began,
        victim: Some(2),
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (replica, url) = serve(&config, "replica 2 again");
    replicas[2] = replica;
    urls.lock().unwrap()[2] = Some(url);
    tokio::time::sleep(calm).await;

    let began = Instant::now();
    drop(node_b);
    faults.push(Fault {
        name: "upstream node b killed",
        began,
        over: began,
        victim: None,
    });
    tokio::time::sleep(calm).await;

    let outcomes = stop_chaos_clients(&stop, clients).await;
    let last_url = urls.lock().unwrap()[0].clone().unwrap();

    check_answers(&outcomes, Some(&faults[3]));
    check_recovery(&outcomes, &faults);
    assert!(
        outcomes.iter().any(|o| o.code == "budget_exceeded"),
        "the budget ran out during the run"
    );
    check_exact(
        &outcomes,
        &[(&metered, "metered"), (&budgeted, "budgeted")],
        &config,
        &last_url,
    )
    .await;
    drop(redis);
    drop(node_a);
    drop(replicas);
}

/// `INFO replication` of the Redis on `port`.
async fn replication_of(port: u16) -> String {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut connection)
        .await
        .unwrap()
}

/// Polls the `INFO replication` of the Redis on `port` until it holds `line`.
async fn until_replication_says(port: u16, line: &str) {
    bounded(SOON, line, async {
        while !replication_of(port).await.lines().any(|l| l.trim() == line) {
            tokio::time::sleep(POLL).await;
        }
    })
    .await;
}

/// A managed Redis failing over mid-load, as ElastiCache, Memorystore or a Sentinel
/// setup does it: the primary hands over to its replica (`FAILOVER`: writes paused until
/// the replica has them all, then the roles swap, the old primary now a replica), and
/// the endpoint the gateways know moves to the new primary. Two replicas and the chaos
/// test's clients, with the budgeted key running out after the failover: only
/// documented answers, both replicas served again within 3 s of the promotion, and the
/// counters on the promoted Redis, the ledger and what the clients were told agree,
/// without overshoot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and redis-server on PATH (set TEST_POSTGRES_URL)"]
async fn a_redis_failover_mid_load_serves_again_within_seconds_with_exact_budgets() {
    let database = FreshDatabase::create("fg_failover").await;
    let dir = tempfile::tempdir().unwrap();
    let (primary_port, replica_port) = (free_port(), free_port());
    // A replica syncing writes the primary's snapshot to its directory (and so does the
    // old primary, once a replica itself): theirs is the test's own.
    let redis_dir = ["--dir", dir.path().to_str().unwrap()];
    let _primary = RedisServer::start_with(
        primary_port,
        &redis_dir,
        &format!("redis://127.0.0.1:{primary_port}"),
    )
    .await;
    let replica_of = ["--replicaof", "127.0.0.1", &primary_port.to_string()];
    let _replica = RedisServer::start_with(
        replica_port,
        &[&redis_dir[..], &replica_of[..]].concat(),
        &format!("redis://127.0.0.1:{replica_port}"),
    )
    .await;
    until_replication_says(replica_port, "master_link_status:up").await;
    until_replication_says(primary_port, "connected_slaves:1").await;
    let endpoint = Forwarder::start(([127, 0, 0, 1], primary_port).into()).await;

    let (node, upstream) = start_mock(2);
    let prefix = format!("fleetgate-test:failover:{}", uuid::Uuid::new_v4().simple());
    let config = write_config(
        dir.path(),
        &database.url,
        &format!("redis://{}", endpoint.address()),
        &prefix,
        &[&upstream],
    );
    let (metered, budgeted) = chaos_keys(&config);
    let (replicas, urls) = serve_replicas(&config, 2);
    let url = urls.lock().unwrap()[0].clone().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = spawn_chaos_clients(&metered, &budgeted, &urls, &stop);
    tokio::time::sleep(Duration::from_secs(3)).await;

    let began = Instant::now();
    let client = redis::Client::open(format!("redis://127.0.0.1:{primary_port}")).unwrap();
    let mut primary = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("FAILOVER")
        .arg("TO")
        .arg("127.0.0.1")
        .arg(replica_port)
        .arg("TIMEOUT")
        .arg(2000)
        .query_async::<()>(&mut primary)
        .await
        .unwrap();
    until_replication_says(replica_port, "role:master").await;
    endpoint.point_at(([127, 0, 0, 1], replica_port).into());
    let faults = [Fault {
        name: "Redis failed over to its replica",
        began,
        over: Instant::now(),
        victim: None,
    }];
    assert!(
        replication_of(primary_port).await.contains("role:slave"),
        "the old primary is a replica now"
    );

    // The load goes on until the budgeted key has run out on the new primary: less left
    // than the smallest request needs (8 tokens).
    bounded(Duration::from_secs(60), "the budget runs out", async {
        while budgeted.usage(&url).await["used"].as_u64().unwrap() + 8 <= CHAOS_BUDGET {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let outcomes = stop_chaos_clients(&stop, clients).await;
    let small = json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4});
    let refused = budgeted.complete_within(ANSWER, &url, &small).await;
    refusal(refused, 429, "budget_exceeded").await;
    check_answers(&outcomes, None);
    check_recovery(&outcomes, &faults);
    check_exact(
        &outcomes,
        &[(&metered, "metered"), (&budgeted, "budgeted")],
        &config,
        &url,
    )
    .await;
    drop(node);
    drop(replicas);
}

/// The chaos tests' two keys: "metered", without a budget to speak of, and "budgeted",
/// with [`CHAOS_BUDGET`].
fn chaos_keys(config: &Path) -> (Api, Api) {
    let metered = Api::new(create_key(config, &["--rpm", "1000000"]));
    let budget = CHAOS_BUDGET.to_string();
    let budgeted = Api::new(create_key(
        config,
        &["--rpm", "1000000", "--monthly-budget", &budget],
    ));
    (metered, budgeted)
}

/// `count` replicas serving `config`, and their URLs.
fn serve_replicas(config: &Path, count: usize) -> (Vec<Proc>, Replicas) {
    let mut replicas = Vec::new();
    let mut urls = Vec::new();
    for i in 0..count {
        let (replica, url) = serve(config, &format!("replica {i}"));
        replicas.push(replica);
        urls.push(Some(url));
    }
    (replicas, Arc::new(Mutex::new(urls)))
}

/// Three clients on each replica of `urls`: two of `metered` back to back, one of
/// `budgeted` at most 8 requests a second.
fn spawn_chaos_clients(
    metered: &Api,
    budgeted: &Api,
    urls: &Replicas,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Outcome>>> {
    let replicas = urls.lock().unwrap().len();
    let mut clients = Vec::new();
    for replica in 0..replicas {
        for (api, key, pace) in [
            (metered, "metered", None),
            (metered, "metered", None),
            // At most 25 requests a second of ~15 tokens on three replicas (fewer on a
            // busy machine): the chaos budget lasts some 10 to 15 s of serving.
            (budgeted, "budgeted", Some(Duration::from_millis(120))),
        ] {
            clients.push(tokio::spawn(chaos_client(
                api.clone(),
                key,
                replica,
                Arc::clone(urls),
                pace,
                Arc::clone(stop),
            )));
        }
    }
    clients
}

/// Stops the clients and gathers how their requests ended.
async fn stop_chaos_clients(
    stop: &AtomicBool,
    clients: Vec<tokio::task::JoinHandle<Vec<Outcome>>>,
) -> Vec<Outcome> {
    stop.store(true, Ordering::Relaxed);
    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.extend(
            bounded(SOON + HUNG, "a chaos client ends", client)
                .await
                .unwrap(),
        );
    }
    outcomes
}

/// Only documented answers; a failed connection only to the replica `kill` killed, while
/// it died. Prints the tally and the slowest answer.
fn check_answers(outcomes: &[Outcome], kill: Option<&Fault>) {
    let allowed = [
        (200, ""),
        (429, "budget_exceeded"),
        (503, "admission_unavailable"),
        (503, "store_unavailable"),
        (503, "upstream_unavailable"),
    ];
    let mut tally = std::collections::BTreeMap::<String, u64>::new();
    for o in outcomes {
        match o.status {
            Some(status) => assert!(
                allowed.contains(&(status, o.code.as_str())),
                "{} on replica {}: {status} {}",
                o.key,
                o.replica,
                o.code
            ),
            None => assert!(
                kill.is_some_and(|kill| Some(o.replica) == kill.victim
                    && o.started <= kill.began
                    && o.ended >= kill.began),
                "{} on replica {}: a connection error away from the kill",
                o.key,
                o.replica
            ),
        }
        let label = o
            .status
            .map_or("connection cut".to_owned(), |s| format!("{s} {}", o.code));
        *tally.entry(label).or_default() += 1;
    }
    let slowest = outcomes.iter().map(|o| o.ended - o.started).max().unwrap();
    eprintln!(
        "{} requests: {tally:?}; slowest {slowest:?}",
        outcomes.len()
    );
}

/// The surviving replicas' clients of the key "metered" were served again within
/// [`RECOVERY`] of each fault's end.
fn check_recovery(outcomes: &[Outcome], faults: &[Fault]) {
    for fault in faults {
        let served_again = outcomes
            .iter()
            .filter(|o| o.key == "metered" && Some(o.replica) != fault.victim)
            .filter(|o| o.status == Some(200) && o.ended >= fault.over)
            .map(|o| o.ended - fault.over)
            .min()
            .unwrap_or_else(|| panic!("{}: never served again", fault.name));
        eprintln!(
            "{}: held {:?}, served again {served_again:?} after",
            fault.name,
            fault.over - fault.began
        );
        assert!(
            served_again <= RECOVERY,
            "{}: served again only after {served_again:?}",
            fault.name
        );
    }
}

/// Exact: for each of `keys`, the counters (read at `url`) and the ledger agree, and hold
/// what the clients were told — plus, at most, what the requests cut by a replica's
/// death generated (charged as for any client gone mid-answer); the key "budgeted" was
/// not charged one token over its [`CHAOS_BUDGET`].
async fn check_exact(outcomes: &[Outcome], keys: &[(&Api, &str)], config: &Path, url: &str) {
    for &(api, key) in keys {
        let ours = || outcomes.iter().filter(|o| o.key == key);
        let told: u64 = ours().map(|o| o.told).sum();
        let cut: u64 = ours().filter(|o| o.status.is_none()).map(|o| o.worst).sum();
        let agreed = bounded(
            Duration::from_secs(25),
            "the counters and the ledger agree",
            async {
                loop {
                    let live = api.usage(url).await["used"].as_u64().unwrap();
                    if live == ledger_used(config, &api.key) && (told..=told + cut).contains(&live)
                    {
                        return live;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            },
        )
        .await;
        eprintln!("{key}: told {told}, charged {agreed} in the counters and the ledger");
        if key == "budgeted" {
            assert!(
                agreed <= CHAOS_BUDGET,
                "overshoot: {agreed} of {CHAOS_BUDGET}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Completion jobs
// ---------------------------------------------------------------------------------------

/// Two replicas over one database and Redis prefix with `[jobs]` settings of their own
/// (`jobs_a`, `jobs_b`), in front of one mock-vllm; replica B is started by the test.
struct JobCluster {
    a: Option<Proc>,
    url_a: String,
    config_b: PathBuf,
    key: String,
    mock: MockNode,
    client: reqwest::Client,
    _redis: RedisPrefix,
    database: FreshDatabase,
    _dir: tempfile::TempDir,
}

impl JobCluster {
    async fn start(test: &str, token_delay_ms: u64, jobs_a: &str, jobs_b: &str) -> Self {
        let redis = RedisPrefix::new(test);
        let database = FreshDatabase::create("fg_replicas").await;
        let dir = tempfile::tempdir().unwrap();
        let (mock, upstream) = start_mock(token_delay_ms);
        let config_with = |name: &str, jobs: &str| {
            let sub = dir.path().join(name);
            std::fs::create_dir_all(&sub).unwrap();
            let path = write_config(&sub, &database.url, &redis.url, &redis.prefix, &[&upstream]);
            let text = std::fs::read_to_string(&path).unwrap();
            let text = text.replacen("[[models]]", &format!("[jobs]\n{jobs}\n\n[[models]]"), 1);
            std::fs::write(&path, text).unwrap();
            path
        };
        let config_a = config_with("a", jobs_a);
        let config_b = config_with("b", jobs_b);
        let key = create_key(
            &config_a,
            &[
                "--rpm",
                "1000000",
                "--max-concurrent",
                "64",
                "--max-queued",
                "1000",
            ],
        );
        let (a, url_a) = serve(&config_a, "replica A");
        Self {
            a: Some(a),
            url_a,
            config_b,
            key,
            mock,
            client: reqwest::Client::new(),
            _redis: redis,
            database,
            _dir: dir,
        }
    }

    /// Replica B.
    fn start_b(&self) -> (Proc, String) {
        serve(&self.config_b, "replica B")
    }

    async fn pg(&self) -> PgConnection {
        PgConnection::connect(&self.database.url).await.unwrap()
    }
}

/// Polls an outside process's state until `done` (at most [`SOON`] × 2).
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let since = Instant::now();
    while !done() {
        assert!(
            since.elapsed() < 2 * SOON,
            "{what}: not within {:?}",
            2 * SOON
        );
        tokio::time::sleep(POLL).await;
    }
}

/// 500 jobs submitted through two replicas whose workers share one PostgreSQL job
/// table: every job ends `succeeded`, and mock-vllm received each job's prompt exactly
/// once; the ledger holds one charge per job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn two_replicas_run_500_jobs_none_twice_none_lost() {
    const JOBS: usize = 500;
    let cluster = JobCluster::start("jobs500", 0, "workers = 8", "workers = 8").await;
    let (_b, url_b) = cluster.start_b();
    let urls = [cluster.url_a.clone(), url_b];
    // Submitted 25 at a time, alternately through A and B.
    let mut ids = Vec::new();
    for batch in (0..JOBS).collect::<Vec<_>>().chunks(25) {
        let submits = batch.iter().map(|&n| {
            let (client, url, key) = (
                cluster.client.clone(),
                urls[n % 2].clone(),
                cluster.key.clone(),
            );
            tokio::spawn(async move {
                common::jobs::submit(&client, &url, &key, &format!("job-{n}"), 2).await
            })
        });
        for submit in submits.collect::<Vec<_>>() {
            ids.push(submit.await.unwrap());
        }
    }
    // Harvested through the other replica than the one that took each.
    let mut charged = 0;
    for (n, id) in ids.iter().enumerate() {
        let job = common::jobs::harvest(
            &cluster.client,
            &urls[(n + 1) % 2],
            &cluster.key,
            id,
            6 * SOON,
        )
        .await;
        assert_eq!(job["status"], "succeeded", "{job}");
        charged += job["result"]["usage"]["total_tokens"].as_u64().unwrap();
    }
    // Both replicas' workers took part.
    for url in &urls {
        let metrics = cluster
            .client
            .get(format!("{url}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let ran = metrics
            .lines()
            .find(|l| l.starts_with("fleetgate_job_runs_total{outcome=\"succeeded\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        assert!(ran > 0.0, "{url} ran no job");
    }
    let prompts = cluster.mock.prompts();
    let mut seen = std::collections::HashMap::new();
    for prompt in &prompts {
        *seen.entry(prompt.as_str()).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), JOBS, "every job ran");
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "ran more than once: {twice:?}");
    let mut pg = cluster.pg().await;
    let (rows, tokens): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), CAST(COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS BIGINT) \
         FROM usage_ledger WHERE request_id LIKE 'job_%'",
    )
    .fetch_one(&mut pg)
    .await
    .unwrap();
    assert_eq!((rows, tokens), (JOBS as i64, charged as i64));
}

/// A replica killed (SIGKILL) while it runs jobs: once their leases lapse, the other
/// replica takes them over; each ends once with its result and is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn jobs_of_a_killed_replica_are_taken_over_by_the_other() {
    const JOBS: usize = 4;
    // 20 tokens 50 ms apart: a run takes about a second.
    let mut cluster = JobCluster::start("jobkill", 50, "lease_ms = 1000", "lease_ms = 1000").await;
    let mut ids = Vec::new();
    for n in 0..JOBS {
        ids.push(
            common::jobs::submit(
                &cluster.client,
                &cluster.url_a,
                &cluster.key,
                &format!("kill-{n}"),
                20,
            )
            .await,
        );
    }
    until("A runs every job", || cluster.mock.in_flight() == JOBS).await;
    let (_b, url_b) = cluster.start_b();
    let mut a = cluster.a.take().unwrap();
    a.0.kill().unwrap();
    a.0.wait().unwrap();
    let mut charged = 0;
    for id in &ids {
        let job = common::jobs::harvest(&cluster.client, &url_b, &cluster.key, id, 3 * SOON).await;
        assert_eq!(job["status"], "succeeded", "{job}");
        charged += job["result"]["usage"]["total_tokens"].as_u64().unwrap();
    }
    assert_eq!(
        cluster.mock.cancelled(),
        JOBS,
        "the killed runs were aborted upstream"
    );
    // Each job reached the node twice: A's run, cut by the kill, and B's.
    let mut prompts = cluster.mock.prompts();
    prompts.sort();
    let expected: Vec<String> = (0..JOBS)
        .flat_map(|n| [format!("kill-{n}"), format!("kill-{n}")])
        .collect();
    assert_eq!(prompts, expected);
    let mut pg = cluster.pg().await;
    let tokens: i64 = sqlx::query_scalar(
        "SELECT CAST(COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS BIGINT) FROM usage_ledger",
    )
    .fetch_one(&mut pg)
    .await
    .unwrap();
    assert_eq!(tokens, charged as i64, "each job charged once");
}

/// A long-poll on replica B (which runs no jobs) wakes within 100 ms of replica A
/// ending the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn a_long_poll_wakes_when_another_replica_ends_the_job() {
    // 10 tokens 30 ms apart: the job ends about 0.3 s after it starts.
    let cluster = JobCluster::start("joblongpoll", 30, "workers = 4", "workers = 0").await;
    let (_b, url_b) = cluster.start_b();
    let mut pg = cluster.pg().await;
    for n in 0..3 {
        let id = common::jobs::submit(
            &cluster.client,
            &url_b,
            &cluster.key,
            &format!("wake-{n}"),
            10,
        )
        .await;
        let response = cluster
            .client
            .get(format!("{url_b}/v1/harvest/{id}?wait=30"))
            .bearer_auth(&cluster.key)
            .send()
            .await
            .unwrap();
        let answered_ms = i64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap();
        let job: Value = response.json().await.unwrap();
        assert_eq!(job["status"], "succeeded", "{job}");
        let finished_ms: i64 = sqlx::query_scalar("SELECT finished_at_ms FROM jobs WHERE id = $1")
            .bind(&id)
            .fetch_one(&mut pg)
            .await
            .unwrap();
        let late = answered_ms - finished_ms;
        assert!(
            (0..100).contains(&late),
            "B answered {late} ms after A ended the job"
        );
    }
}
