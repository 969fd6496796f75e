//! The noisy neighbour (issue #33's test of tenant isolation): while key A runs every
//! abuse vector at once, key B's small completions keep 0 errors and a p99 within 2× of
//! their unloaded p99, and the process's resident memory stays under the bound that
//! docs/limits.md documents.
//!
//! One gateway (default settings) serves two models: B's, on a healthy node of its own,
//! and A's, on three nodes of which one answers `/tokenize`, `/v1/models` and `/metrics`
//! without end and one streams past `max_tokens`. B measures itself alone, then again
//! while A, from a thread and runtime of its own (a client machine of its own, as far as
//! two shared cores allow), runs every vector at once, each paced and each ended when B
//! is done (or, at the latest, after [`ATTACK_LIMIT`]).
//!
//! A target of its own rather than a suite of `tests/it`: the resident memory read here
//! is the whole process's, which must hold this gateway and nothing of other tests.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

#[expect(
    dead_code,
    reason = "this suite uses the in-process gateway and its nodes, not the rest"
)]
mod common;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::h2::h2_preface;
use common::{Gateway, MODEL, fleet_toml, model_toml, node};
use fleetgate::store::LimitOverrides;
use mock_vllm::{FailureMode, MockConfig};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// The model of key A's requests, served by its hostile nodes alone.
const A_MODEL: &str = "noisy";
/// The context length of A's nodes, and so what a request without `max_tokens` may
/// generate. mock-vllm works out a whole answer before it paces it out, on the test's
/// runtime beside B's node: answers of thousands of tokens would have A's nodes take
/// the cores from B's (which on a real fleet are other machines).
const A_CONTEXT: u32 = 256;
/// B's completions measured in each phase, one at a time, one every [`B_EVERY`].
const B_REQUESTS: usize = 500;
const B_EVERY: Duration = Duration::from_millis(10);
/// The floor under B's unloaded p99. In a debug build on two shared cores B's p50 is
/// 2–3 ms and its unloaded p99 alone ranges from 4 to 12 ms from one run to the next:
/// below the floor, a difference is the scheduler's jitter, not the gateway's doing. A
/// gateway that lets A starve B costs B far more than twice this (hundreds of
/// milliseconds when A's nodes were let take the cores, see [`A_CONTEXT`]).
const P99_FLOOR: Duration = Duration::from_millis(10);
/// The resident memory the gateway holds at most under abuse with default settings, as
/// documented in docs/limits.md. This process also holds the nodes and both clients, so
/// the figure read here over-counts the gateway's.
const RSS_BOUND_MIB: f64 = 512.0;
/// A's vectors stop by themselves after this, should B never finish.
const ATTACK_LIMIT: Duration = Duration::from_secs(40);
/// Every single request, connection and wait of the test is bounded by this.
const LIMIT: Duration = Duration::from_secs(10);

/// Idle connections A holds open, half of them HTTP/2 ones that sent their preface and
/// settings and then nothing.
const IDLE_CONNECTIONS: usize = 200;
/// Connections on which A trickles a Workbench body, a byte every [`TRICKLE_EVERY`].
const TRICKLERS: usize = 8;
const TRICKLE_EVERY: Duration = Duration::from_millis(100);
/// Requests with no key, a wrong one or an unknown one: one every 5 ms (200 a second).
const NOISE_EVERY: Duration = Duration::from_millis(5);
/// A's `requests_per_minute`: it may start 600 at once, then 10 a second.
const A_RATE: u32 = 600;
/// A's requests whose prompt must be counted, far beyond its rate: ~43 a second. (The
/// paces of the vectors that share A's rate are not multiples of each other nor of the
/// rate's 100 ms, so that none always comes just after another has taken the rate's
/// next start.)
const OVER_RATE_EVERY: Duration = Duration::from_millis(23);
/// A's streams to its nodes (one overgenerates), ~14 a second, and the answers it walks
/// away from, ~11 a second.
const STREAM_EVERY: Duration = Duration::from_millis(70);
const ABANDON_EVERY: Duration = Duration::from_millis(90);
/// A's clients that each send a request of 1 s about every second, all at once: many
/// more than A's four places (two running, two waiting). With A at its rate, those the
/// rate lets in find the places taken by A's other requests now and then too.
const GREEDY_CLIENTS: usize = 16;
const GREEDY_EVERY: Duration = Duration::from_millis(970);

/// Latency figures of one of B's phases.
struct Phase {
    p50: Duration,
    p99: Duration,
    errors: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_running_every_abuse_vector_leaves_another_keys_latency_and_the_memory_bounded() {
    // B's node answers at once; A's nodes generate a token every 5 ms, and once A
    // attacks, one of them answers its small questions without end, one streams past
    // `max_tokens`.
    let b_node = node(MockConfig::default()).await;
    let slow = || MockConfig {
        token_delay: Duration::from_millis(5),
        max_model_len: A_CONTEXT,
        ..MockConfig::default()
    };
    let (endless, overgenerating, plain) =
        (node(slow()).await, node(slow()).await, node(slow()).await);
    let dir = tempfile::tempdir().unwrap();
    let toml = fleet_toml(dir.path(), "", "", &[(&b_node, "gpu-b", "")])
        + &model_toml(
            A_MODEL,
            "",
            &[
                (&endless, "gpu-a1", ""),
                (&overgenerating, "gpu-a2", ""),
                (&plain, "gpu-a3", ""),
            ],
        );
    let gw = Gateway::start_config(b_node, &toml, dir).await;
    // B's own rate is its pace (100 a second) and no less: B stays within its limits.
    let (_, b_key) = gw
        .create_key(LimitOverrides {
            requests_per_minute: Some(6000),
            ..LimitOverrides::default()
        })
        .await;
    let (_, a_key) = gw
        .create_key(LimitOverrides {
            requests_per_minute: Some(A_RATE),
            max_concurrent: Some(2),
            max_queued: Some(2),
            ..LimitOverrides::default()
        })
        .await;

    let rss_before = rss_mib();
    let unloaded = measure_b(&gw, &b_key).await;

    // A's nodes turn hostile with A (the prober asks the endless one every 2 s).
    endless.set_failure(FailureMode::Endless);
    overgenerating.set_failure(FailureMode::Overgenerate);
    let stop = CancellationToken::new();
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    let attack = {
        let target = Target {
            url: gw.url.clone(),
            key: a_key,
            stop: stop.clone(),
        };
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(target.attack(ready_tx))
        })
    };
    // Opening the connections and spending the rate (600 requests one after another)
    // take a few seconds; half the attack's bound leaves B's phase the other half.
    let started = tokio::time::timeout(ATTACK_LIMIT / 2, ready)
        .await
        .expect("A's attack got under way");
    if started.is_err() {
        // The attack ended before it was under way: its panic says why.
        std::panic::resume_unwind(attack.join().expect_err("the attack panicked"));
    }
    let sampled = CancellationToken::new();
    let sampler = tokio::spawn(max_rss_until(sampled.clone()));
    let loaded = measure_b(&gw, &b_key).await;
    let attack_ran_throughout = !stop.is_cancelled();
    stop.cancel();
    sampled.cancel();
    let rss_max = sampler.await.unwrap();
    let tally = tokio::task::spawn_blocking(move || attack.join())
        .await
        .unwrap()
        .unwrap();

    let floor = unloaded.p99.max(P99_FLOOR);
    eprintln!(
        "B unloaded: p50 {:?}, p99 {:?}, {} errors",
        unloaded.p50,
        unloaded.p99,
        unloaded.errors.len()
    );
    eprintln!(
        "B while A runs every vector: p50 {:?}, p99 {:?}, {} errors (bound: 2 × max(unloaded p99, {P99_FLOOR:?}) = {:?})",
        loaded.p50,
        loaded.p99,
        loaded.errors.len(),
        2 * floor
    );
    eprintln!(
        "RSS: {rss_before:.1} MiB before, at most {rss_max:.1} MiB under load (bound {RSS_BOUND_MIB} MiB)"
    );
    for (vector, outcomes) in &tally {
        eprintln!("A {vector}: {outcomes:?}");
    }

    assert!(
        attack_ran_throughout,
        "A's vectors stopped before B was done"
    );
    assert!(
        tally["burst"].contains_key("429 rate_limited"),
        "A's rate was never spent: {tally:?}"
    );
    for vector in [
        "noise",
        "over rate",
        "streams",
        "abandoned",
        "greedy",
        "trickled",
    ] {
        assert!(
            tally.get(vector).is_some_and(|o| !o.is_empty()),
            "A's {vector} vector sent nothing: {tally:?}"
        );
    }
    assert!(
        unloaded.errors.is_empty(),
        "{:?}",
        &unloaded.errors[..3.min(unloaded.errors.len())]
    );
    assert!(
        loaded.errors.is_empty(),
        "{:?}",
        &loaded.errors[..3.min(loaded.errors.len())]
    );
    assert!(
        loaded.p99 <= 2 * floor,
        "B's p99 went from {:?} to {:?} while A ran",
        unloaded.p99,
        loaded.p99
    );
    assert!(
        rss_max < RSS_BOUND_MIB,
        "{rss_max:.1} MiB resident (bound {RSS_BOUND_MIB} MiB)"
    );
}

/// B's [`B_REQUESTS`] small completions, one every [`B_EVERY`], each awaited whole.
async fn measure_b(gw: &Gateway, key: &str) -> Phase {
    let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8}).to_string();
    let mut ticker = tokio::time::interval(B_EVERY);
    let (mut took, mut errors) = (Vec::with_capacity(B_REQUESTS), Vec::new());
    for _ in 0..B_REQUESTS {
        ticker.tick().await;
        let started = Instant::now();
        let answer = async {
            let response = gw.complete_as(key, &body).timeout(LIMIT).send().await?;
            let status = response.status();
            let body = response.bytes().await?;
            Ok::<_, reqwest::Error>((status, body))
        };
        match answer.await {
            Ok((status, _)) if status == 200 => took.push(started.elapsed()),
            Ok((status, body)) => {
                errors.push(format!("{status}: {}", String::from_utf8_lossy(&body)))
            }
            Err(err) => errors.push(err.to_string()),
        }
    }
    took.sort_unstable();
    let at = |share: usize| {
        took.get((took.len() * share).div_ceil(100).saturating_sub(1))
            .copied()
            .unwrap_or_default()
    };
    Phase {
        p50: at(50),
        p99: at(99),
        errors,
    }
}

/// This process's resident set (`VmRSS`), in MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .expect("VmRSS in /proc/self/status")
        .trim()
        .parse()
        .unwrap();
    kib / 1024.0
}

/// The most resident memory seen, sampled every 20 ms until `done`.
async fn max_rss_until(done: CancellationToken) -> f64 {
    let mut ticker = tokio::time::interval(Duration::from_millis(20));
    let mut max = rss_mib();
    while done.run_until_cancelled(ticker.tick()).await.is_some() {
        max = max.max(rss_mib());
    }
    max
}

/// What A's requests of each vector came to: status code (or how the client ended
/// them) → count.
type Tally = BTreeMap<&'static str, BTreeMap<String, usize>>;

/// Key A and the gateway it attacks, and the signal that ends the attack.
#[derive(Clone)]
struct Target {
    url: String,
    key: String,
    stop: CancellationToken,
}

impl Target {
    /// Every vector at once; `ready` once A's rate is spent (what its nodes see from then
    /// on is what the rate lets through), its idle connections are open and every other
    /// vector has started. Returns when every vector has stopped.
    async fn attack(self, ready: tokio::sync::oneshot::Sender<()>) -> Tally {
        let deadline = tokio::time::Instant::now() + ATTACK_LIMIT;
        let stop = self.stop.clone();
        // The attack's own bound, so that it ends even if the test never says so.
        let stopper = tokio::spawn(async move {
            if stop
                .run_until_cancelled(tokio::time::sleep_until(deadline))
                .await
                .is_some()
            {
                stop.cancel();
            }
        });
        let tally = Arc::new(Mutex::new(Tally::new()));
        let client = reqwest::Client::builder()
            .no_gzip()
            .timeout(LIMIT)
            .build()
            .unwrap();

        // Idle connections, half of them HTTP/2 ones that said their preface and
        // settings, held until the attack ends.
        let mut idle = Vec::with_capacity(IDLE_CONNECTIONS);
        for i in 0..IDLE_CONNECTIONS {
            let mut stream = self.connect().await;
            if i % 2 == 0 {
                stream.write_all(&h2_preface()).await.unwrap();
            }
            idle.push(stream);
        }
        // The rate's burst spent at once, on one-token answers.
        let cheap = self.completion(&client, json!({"prompt": [1], "max_tokens": 1}));
        for _ in 0..=A_RATE + 100 {
            let response = cheap.try_clone().unwrap().send().await;
            let ended = outcome(response).await;
            let spent = ended == "429 rate_limited";
            count(&tally, "burst", ended);
            if spent {
                break;
            }
        }
        let mut vectors = JoinSet::new();
        // Strangers: no key, a malformed one, a wrong one, and one that is well formed
        // but unknown (which waits for the key table's next pull before its 401).
        let unknown = fleetgate::key_secret::generate().secret.expose().to_owned();
        let mut n = 0usize;
        vectors.spawn(self.paced("noise", &tally, NOISE_EVERY, {
            let (target, client) = (self.clone(), client.clone());
            move || {
                n += 1;
                let request = client
                    .post(format!("{}/v1/completions", target.url))
                    .header("content-type", "application/json")
                    .body(json!({"model": A_MODEL, "prompt": [1], "max_tokens": 1}).to_string());
                match n % 4 {
                    0 => request,
                    1 => request.header("authorization", "Basic dXNlcjpwYXNz"),
                    2 => request.bearer_auth("sk-not-a-key"),
                    _ => request.bearer_auth(&unknown),
                }
                .send()
            }
        }));
        // Requests whose text prompt must be counted (no `max_tokens`), far over A's
        // rate: those the rate or the queue refuses are refused before the count; those
        // let in have it counted by one of A's nodes (the endless one's answer is cut
        // at its bound) and run until A leaves them, after 500 ms.
        vectors.spawn(self.paced("over rate", &tally, OVER_RATE_EVERY, {
            let request = self
                .completion(&client, json!({"prompt": "Count every one of these words"}))
                .timeout(Duration::from_millis(500));
            move || request.try_clone().unwrap().send()
        }));
        // Streams, some of which land on the node that goes past `max_tokens`.
        vectors.spawn(self.paced("streams", &tally, STREAM_EVERY, {
            let request = self.completion(
                &client,
                json!({"prompt": [1, 2, 3], "max_tokens": 16, "stream": true}),
            );
            move || request.try_clone().unwrap().send()
        }));
        // Non-streaming answers of 200 tokens (1 s) that A leaves after 200 ms.
        vectors.spawn(self.paced("abandoned", &tally, ABANDON_EVERY, {
            let request = self
                .completion(&client, json!({"prompt": [1, 2, 3], "max_tokens": 200}))
                .timeout(Duration::from_millis(200));
            move || request.try_clone().unwrap().send()
        }));
        // Bursts of requests beyond A's running and waiting places.
        for _ in 0..GREEDY_CLIENTS {
            let request = self.completion(&client, json!({"prompt": [1, 2, 3], "max_tokens": 200}));
            let (target, tally) = (self.clone(), Arc::clone(&tally));
            vectors.spawn(async move {
                let mut ticker = tokio::time::interval(GREEDY_EVERY);
                while target
                    .stop
                    .run_until_cancelled(ticker.tick())
                    .await
                    .is_some()
                {
                    let sent = request.try_clone().unwrap().send();
                    let Some(ended) = target
                        .stop
                        .run_until_cancelled(async { outcome(sent.await).await })
                        .await
                    else {
                        break;
                    };
                    count(&tally, "greedy", ended);
                }
            });
        }
        // Workbench bodies trickled a byte at a time.
        for _ in 0..TRICKLERS {
            vectors.spawn(self.clone().trickle(Arc::clone(&tally)));
        }

        ready.send(()).unwrap();
        while let Some(ended) = vectors.join_next().await {
            ended.unwrap();
        }
        drop(idle);
        stopper.await.unwrap();
        Arc::into_inner(tally).unwrap().into_inner().unwrap()
    }

    /// `POST /v1/completions` to A's model with key A, `fields` in its body.
    fn completion(
        &self,
        client: &reqwest::Client,
        mut fields: serde_json::Value,
    ) -> reqwest::RequestBuilder {
        fields["model"] = A_MODEL.into();
        client
            .post(format!("{}/v1/completions", self.url))
            .bearer_auth(&self.key)
            .header("content-type", "application/json")
            .body(fields.to_string())
    }

    /// Sends a request made by `request` every `every`, each in a task of its own,
    /// until the attack ends; tallies how each ended under `vector`.
    fn paced<F, R>(
        &self,
        vector: &'static str,
        tally: &Arc<Mutex<Tally>>,
        every: Duration,
        mut request: F,
    ) -> impl Future<Output = ()> + Send + 'static
    where
        F: FnMut() -> R + Send + 'static,
        R: Future<Output = reqwest::Result<reqwest::Response>> + Send + 'static,
    {
        let (stop, tally) = (self.stop.clone(), Arc::clone(tally));
        async move {
            let mut ticker = tokio::time::interval(every);
            let mut sent = JoinSet::new();
            while stop.run_until_cancelled(ticker.tick()).await.is_some() {
                let (stop, tally, request) = (stop.clone(), Arc::clone(&tally), request());
                sent.spawn(async move {
                    let ended = stop.run_until_cancelled(async { outcome(request.await).await });
                    if let Some(ended) = ended.await {
                        count(&tally, vector, ended);
                    }
                });
            }
            sent.join_all().await;
        }
    }

    /// One connection after another on which a Workbench item is sent a byte every
    /// [`TRICKLE_EVERY`], until the attack ends.
    async fn trickle(self, tally: Arc<Mutex<Tally>>) {
        let body =
            json!({"kind": "prompt", "title": "trickled", "content": {"prompt": "a".repeat(40)}})
                .to_string();
        let head = format!(
            "POST /v1/workbench/items HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.key,
            body.len()
        );
        let mut ticker = tokio::time::interval(TRICKLE_EVERY);
        'connections: while !self.stop.is_cancelled() {
            let mut stream = self.connect().await;
            let mut sent = stream.write_all(head.as_bytes()).await.is_ok();
            for byte in body.bytes() {
                if !sent {
                    break;
                }
                if self.stop.run_until_cancelled(ticker.tick()).await.is_none() {
                    count(&tally, "trickled", "stopped mid-body".to_owned());
                    break 'connections;
                }
                sent = stream.write_all(&[byte]).await.is_ok();
            }
            // The answer's status line, or how the connection ended.
            let mut answer = [0u8; 12];
            let read = self
                .stop
                .run_until_cancelled(tokio::time::timeout(LIMIT, stream.read_exact(&mut answer)))
                .await;
            let ended = match read {
                None => break,
                Some(Ok(Ok(_))) => String::from_utf8_lossy(&answer[9..]).into_owned(),
                Some(Ok(Err(_))) => "closed".to_owned(),
                Some(Err(_)) => "no answer".to_owned(),
            };
            count(&tally, "trickled", ended);
        }
    }

    async fn connect(&self) -> TcpStream {
        let connect = TcpStream::connect(self.url.trim_start_matches("http://"));
        tokio::time::timeout(LIMIT, connect).await.unwrap().unwrap()
    }
}

/// How a request ended: its status once its body is read to the end (or cut), with the
/// error's code if it is one, or how the client gave up.
async fn outcome(response: reqwest::Result<reqwest::Response>) -> String {
    match response {
        Ok(response) if !response.status().is_success() => {
            let status = response.status().as_u16();
            let body: serde_json::Value = response.json().await.unwrap_or_default();
            format!("{status} {}", body["error"]["code"].as_str().unwrap_or("?"))
        }
        Ok(mut response) => {
            let status = response.status().as_u16().to_string();
            loop {
                match response.chunk().await {
                    Ok(Some(_)) => {}
                    Ok(None) => return status,
                    Err(err) if err.is_timeout() => return format!("{status}, left"),
                    Err(_) => return format!("{status}, cut"),
                }
            }
        }
        Err(err) if err.is_timeout() => "left".to_owned(),
        Err(_) => "error".to_owned(),
    }
}

fn count(tally: &Mutex<Tally>, vector: &'static str, outcome: String) {
    *tally
        .lock()
        .unwrap()
        .entry(vector)
        .or_default()
        .entry(outcome)
        .or_default() += 1;
}
