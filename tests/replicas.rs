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
    pub mod postgres;
    pub mod processes;
}

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::postgres::FreshDatabase;
use common::processes::{FLEETGATE, MockNode, Proc, serve, start_mock};
use sqlx::{AssertSqlSafe, Connection as _, PgConnection};

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::time::timeout;

const REDIS_URL_VAR: &str = "TEST_REDIS_URL";
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
    upstream: &str,
) -> PathBuf {
    let path = dir.join("fleetgate.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\n\
             database_url = \"{database_url}\"\n\
             redis_url = \"{redis_url}\"\n\
             redis_key_prefix = \"{prefix}\"\n\n\
             [[models]]\nid = \"{MODEL}\"\n\n\
             [[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"gpu-a\"\n"
        ),
    )
    .unwrap();
    path
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
            &upstream,
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

/// A TCP port that was free a moment ago.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A private `redis-server` without persistence; killed (SIGKILL) when dropped.
struct RedisServer(Child);

impl RedisServer {
    /// Starts it on `port` and waits until it answers PING.
    async fn start(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        let mut server = Self(child);
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
        bounded(SOON, "redis-server answers PING", async {
            loop {
                if let Some(status) = server.0.try_wait().unwrap() {
                    panic!("redis-server on port {port} exited at start: {status}");
                }
                let pong = async {
                    let mut connection = client.get_multiplexed_async_connection().await?;
                    redis::cmd("PING")
                        .query_async::<String>(&mut connection)
                        .await
                };
                if matches!(timeout(Duration::from_secs(1), pong).await, Ok(Ok(_))) {
                    return;
                }
                // An outside process: poll until it is up.
                tokio::time::sleep(POLL).await;
            }
        })
        .await;
        server
    }

    /// SIGKILL, as a crash.
    fn kill(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
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
            &upstream,
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

/// PostgreSQL unreachable under load (connections ended, database renamed): both
/// replicas keep serving the key they hold in memory — never a 500 — while its usage
/// waits in their write-behind writers; a key they do not hold is 503
/// `store_unavailable` with `Retry-After`. Once the database is back, the ledger, the
/// live counters and what the clients were told agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PostgreSQL and Redis (set TEST_POSTGRES_URL, TEST_REDIS_URL)"]
async fn a_postgres_outage_stops_no_traffic_and_loses_no_usage() {
    let cluster = Cluster::start("pgout", 0, &[]).await;
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
    let back = Instant::now();
    loop {
        let ledger: Value = serde_json::from_str(&fleetgate(
            &cluster.config,
            &["keys", "usage", &api.key[..12], "--json"],
        ))
        .unwrap();
        if ledger["used_tokens"] == told {
            break;
        }
        assert!(
            back.elapsed() < SOON,
            "the ledger has {ledger}, the clients were told {told}"
        );
        tokio::time::sleep(POLL).await;
    }
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
    // 2000 tokens 50 ms apart: the stream would run 100 s.
    let slow =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "stream": true});
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
    // 2000 tokens 50 ms apart: each stream would run 100 s; the test ends them.
    let slow =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "stream": true});

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
    let settled = Instant::now();
    loop {
        let ledger: Value = serde_json::from_str(&fleetgate(
            &cluster.config,
            &["keys", "usage", &api.key[..12], "--json"],
        ))
        .unwrap();
        if ledger["used_tokens"] == charged {
            break;
        }
        assert!(
            settled.elapsed() < Duration::from_secs(1),
            "the ledger has {ledger}, the counters {charged}"
        );
        tokio::time::sleep(POLL).await;
    }
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

/// Sends a signal (`STOP`, `CONT`) to a private redis-server.
fn signal(redis: &RedisServer, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &redis.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name}");
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

    signal(&redis, "STOP");
    expect_admission_unavailable(&api, &url, &quick).await;
    signal(&redis, "CONT");

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
    signal(&redis, "STOP");
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
    signal(&redis, "CONT");

    let usage = api
        .wait_usage(&url, "the retried settlements applied", |u| {
            u["running"] == 0 && u["reserved"] == 0 && u["used"] == told
        })
        .await;
    assert_eq!(usage["used"], told, "{usage}");
    let ledger: Value = serde_json::from_str(&fleetgate(
        config,
        &["keys", "usage", &api.key[..12], "--json"],
    ))
    .unwrap();
    assert_eq!(ledger["used_tokens"], told, "{ledger}");
}
