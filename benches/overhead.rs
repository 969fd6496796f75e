//! What the gateway adds: the same requests sent straight to mock-vllm, through
//! fleetgate with limits off, and through fleetgate with admission in process and in
//! Redis — sequentially (latency: p50/p99) and with concurrency (throughput). Prints the
//! figures and the differences; asserts nothing.
//!
//! `cargo bench --bench overhead` (env: BENCH_REQUESTS, default 2000; BENCH_CONCURRENCY,
//! default 16; BENCH_REDIS_URL, default redis://127.0.0.1:6379).

#![allow(clippy::expect_used, reason = "a benchmark stops at the first failure")]

use std::time::{Duration, Instant};

use fleetgate::config::Config;
use fleetgate::server;
use fleetgate::store::LimitOverrides;
use futures_util::StreamExt;
use mock_vllm::{MockConfig, MockVllm};

const BODY: &str = r#"{"model":"MODEL","prompt":"The capital of France is","max_tokens":4,"temperature":0.7,"top_k":20}"#;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Target {
    name: &'static str,
    url: String,
    body: String,
    key: Option<String>,
}

async fn one(client: &reqwest::Client, target: &Target) -> Duration {
    let start = Instant::now();
    let mut request = client
        .post(&target.url)
        .header("content-type", "application/json")
        .body(target.body.clone());
    if let Some(key) = &target.key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.expect("request");
    assert!(response.status().is_success(), "{}", response.status());
    response.bytes().await.expect("body");
    start.elapsed()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn latency(client: &reqwest::Client, target: &Target, n: usize) -> Vec<Duration> {
    for _ in 0..n / 10 {
        one(client, target).await; // warm-up
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        samples.push(one(client, target).await);
    }
    samples.sort();
    samples
}

async fn throughput(
    client: &reqwest::Client,
    target: &Target,
    n: usize,
    concurrency: usize,
) -> f64 {
    let start = Instant::now();
    futures_util::stream::iter(0..n)
        .for_each_concurrent(concurrency, |_| async {
            one(client, target).await;
        })
        .await;
    n as f64 / start.elapsed().as_secs_f64()
}

/// A gateway in front of `upstream` with `extra` config lines; returns its completions
/// URL and a key with limits high enough never to refuse the benchmark.
async fn gateway(
    upstream: &str,
    dir: &std::path::Path,
    name: &str,
    extra: &str,
) -> (String, String) {
    let config = Config::from_toml(&format!(
        "database_url = \"sqlite://{}/{name}.db\"\n{extra}\n[[models]]\nid = \"m\"\n[[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"g\"\n",
        dir.display(),
    ))
    .expect("config");
    let state = server::prepare(config).await.expect("state");
    let key = fleetgate::key_secret::generate();
    let generous = LimitOverrides {
        monthly_budget: Some(1 << 50),
        requests_per_minute: Some(i32::MAX as u32),
        max_concurrent: Some(1024),
        max_queued: Some(1024),
        share: None,
    };
    state
        .store()
        .create_key(name, None, &key, &generous)
        .await
        .expect("key");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/v1/completions",
        listener.local_addr().expect("addr")
    );
    tokio::spawn(server::serve(state, listener, std::future::pending()));
    (url, key.secret.expose().to_owned())
}

/// Deletes the benchmark's Redis keys.
async fn clean_redis(url: &str, prefix: &str) {
    let Ok(client) = redis::Client::open(url) else {
        return;
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return;
    };
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap_or_default();
    if !keys.is_empty() {
        let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
    }
}

#[tokio::main]
async fn main() {
    let n = env_or("BENCH_REQUESTS", 2000);
    let concurrency = env_or("BENCH_CONCURRENCY", 16);
    let redis_url =
        std::env::var("BENCH_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let prefix = format!("fleetgate-bench-{}", std::process::id());
    let mock = MockVllm::start(MockConfig::default()).await.expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let upstream = mock.url();
    let served = MockConfig::default().served_model_name;

    let mut targets = vec![Target {
        name: "direct",
        url: format!("{upstream}/v1/completions"),
        body: BODY.replace("MODEL", &served),
        key: None,
    }];
    for (name, extra) in [
        ("limits off", "[limits]\nenabled = false".to_owned()),
        ("in-process", String::new()),
        (
            "redis",
            format!("redis_url = \"{redis_url}\"\nredis_key_prefix = \"{prefix}\""),
        ),
    ] {
        let (url, key) = gateway(&upstream, dir.path(), &name.replace(' ', "-"), &extra).await;
        targets.push(Target {
            name,
            url,
            body: BODY.replace("MODEL", "m"),
            key: Some(key),
        });
    }

    let client = reqwest::Client::new();
    println!("{n} sequential requests per target, then {n} at concurrency {concurrency}");
    let mut measured = Vec::new();
    for target in &targets {
        let samples = latency(&client, target, n).await;
        let (p50, p99) = (percentile(&samples, 0.5), percentile(&samples, 0.99));
        let rps = throughput(&client, target, n, concurrency).await;
        println!(
            "{:<11} p50 {:>7.1} µs  p99 {:>7.1} µs  throughput {:>7.0} req/s",
            target.name,
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            rps
        );
        measured.push((p50, p99));
    }
    clean_redis(&redis_url, &prefix).await;
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let added = |name: &str, (p50, p99): (Duration, Duration), (b50, b99): (Duration, Duration)| {
        println!(
            "{name:<34} p50 {:>+7.1} µs  p99 {:>+7.1} µs",
            micros(p50) - micros(b50),
            micros(p99) - micros(b99)
        );
    };
    added("gateway (limits off) over direct", measured[1], measured[0]);
    added("admission, in-process", measured[2], measured[1]);
    added("admission, redis", measured[3], measured[1]);
}
