//! What the gateway adds: the same requests sent straight to mock-vllm and through
//! fleetgate, sequentially (latency: p50/p99 and the overhead between them) and with
//! concurrency (throughput). Prints figures; asserts nothing.
//!
//! `cargo bench --bench overhead` (env: BENCH_REQUESTS, default 2000; BENCH_CONCURRENCY,
//! default 16).

#![allow(clippy::expect_used, reason = "a benchmark stops at the first failure")]

use std::time::{Duration, Instant};

use fleetgate::config::Config;
use fleetgate::mock_vllm::{MockConfig, MockVllm};
use fleetgate::server;
use futures_util::StreamExt;

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

#[tokio::main]
async fn main() {
    let n = env_or("BENCH_REQUESTS", 2000);
    let concurrency = env_or("BENCH_CONCURRENCY", 16);
    let mock = MockVllm::start(MockConfig::default()).await.expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = Config::from_toml(&format!(
        "database_url = \"sqlite://{}/bench.db\"\n[[models]]\nid = \"m\"\n[[models.upstreams]]\nurl = \"{}\"\ngpu = \"g\"\n",
        dir.path().display(),
        mock.url()
    ))
    .expect("config");
    let state = server::prepare(config).await.expect("state");
    let key = fleetgate::keys::generate();
    state
        .store()
        .create_key("bench", None, &key, &Default::default())
        .await
        .expect("key");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let gateway = format!(
        "http://{}/v1/completions",
        listener.local_addr().expect("addr")
    );
    tokio::spawn(server::serve(state, listener, std::future::pending()));

    let served = MockConfig::default().served_model_name;
    let targets = [
        Target {
            name: "direct",
            url: format!("{}/v1/completions", mock.url()),
            body: BODY.replace("MODEL", &served),
            key: None,
        },
        Target {
            name: "fleetgate",
            url: gateway,
            body: BODY.replace("MODEL", "m"),
            key: Some(key.secret.expose().to_owned()),
        },
    ];
    let client = reqwest::Client::new();
    println!("{n} sequential requests each, then {n} at concurrency {concurrency}");
    let mut p50s = Vec::new();
    for target in &targets {
        let samples = latency(&client, target, n).await;
        let (p50, p99) = (percentile(&samples, 0.5), percentile(&samples, 0.99));
        let rps = throughput(&client, target, n, concurrency).await;
        println!(
            "{:<10} p50 {:>7.1} µs  p99 {:>7.1} µs  throughput {:>7.0} req/s",
            target.name,
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            rps
        );
        p50s.push((p50, p99));
    }
    let (direct, gateway) = (p50s[0], p50s[1]);
    println!(
        "overhead   p50 {:>7.1} µs  p99 {:>7.1} µs",
        (gateway.0.as_secs_f64() - direct.0.as_secs_f64()) * 1e6,
        (gateway.1.as_secs_f64() - direct.1.as_secs_f64()) * 1e6
    );
}
