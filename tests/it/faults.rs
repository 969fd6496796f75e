//! Fault injection with several mock-vllm nodes behind one model: a node refusing
//! connections, one answering 500, one hanging, one cutting a stream, one killed and
//! restarted, all nodes down, and nodes at their `max_in_flight`. Each gives the
//! documented client-visible result, traffic moves to the healthy node within a
//! second, the `/metrics` series follow, and nothing hangs (every test is bounded).

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use crate::common::{Gateway, MODEL, Sample, expect_error, node, parse_metrics};
use fleetgate::store::LimitOverrides;
use mock_vllm::{FailureMode, MockConfig, MockVllm};
use tokio::task::JoinHandle;

/// Fast probes and short back-offs, so that every fault plays out in well under a second.
const FAST_FLEET: &str = "probe_interval_ms = 100
probe_timeout_ms = 200
eject_base_ms = 300
eject_max_ms = 1000";

/// No test may take longer than this; a hang fails the test instead of stalling the suite.
const TEST_LIMIT: Duration = Duration::from_secs(30);

/// A short non-streaming completion.
const JSON: &str = r#"{"model":"llama-8b","prompt":[1,2,3],"max_tokens":4}"#;

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .expect("the test hung")
}

/// A gateway in front of `nodes` (mock, GPU label, extra upstream keys), with
/// [`FAST_FLEET`] plus `fleet` in its `[fleet]` table. `gw.mock` is the first node.
async fn gateway(fleet: &str, nodes: &[(&MockVllm, &str, &str)]) -> Gateway {
    // A rate limit no loop of requests here can reach: these tests are about nodes.
    let top_level =
        format!("[fleet]\n{FAST_FLEET}\n{fleet}\n[limits]\nrequests_per_minute = 1000000\n");
    Gateway::start_fleet(&top_level, "", nodes).await
}

/// Two equal nodes, `a` and `b`; node `a` is built from `a_config`.
async fn two_nodes(a_config: MockConfig) -> (Gateway, MockVllm, MockVllm) {
    let a = node(a_config).await;
    let b = node(MockConfig::default()).await;
    let gw = gateway("", &[(&a, "a", ""), (&b, "b", "")]).await;
    (gw, a, b)
}

/// Completions the node has received.
fn completions(mock: &MockVllm) -> usize {
    mock.received()
        .iter()
        .filter(|r| r.path == "/v1/completions")
        .count()
}

/// The node that ran (or failed) the request, from `X-Acs-Upstream-Gpu`.
fn gpu(response: &reqwest::Response) -> String {
    response.headers()["x-acs-upstream-gpu"]
        .to_str()
        .unwrap()
        .to_owned()
}

/// Sends [`JSON`], expects a whole 200 and returns the node that served it.
async fn ok_from(gw: &Gateway) -> String {
    let response = gw.complete(JSON).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let served_by = gpu(&response);
    response.bytes().await.unwrap();
    served_by
}

/// Asserts a retryable gateway error: `Retry-After: 1` and the error kind header.
async fn expect_retryable(response: reqwest::Response, status: u16, code: &str) {
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(response.headers()["x-acs-upstream-error-kind"], code);
    expect_error(response, status, code).await;
}

/// Reads a streamed body to its end: the text, and whether it ended in an error
/// rather than cleanly.
async fn read_stream(mut response: reqwest::Response) -> (String, bool) {
    let mut text = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => text.extend_from_slice(&chunk),
            Ok(None) => return (String::from_utf8(text).unwrap(), false),
            Err(_) => return (String::from_utf8(text).unwrap(), true),
        }
    }
}

/// A request held on a node behind its closed gate. With two nodes, power of two
/// choices always picks the lighter one, so while it is held every new request goes to
/// the other node (as long as that one is up and holds nothing).
struct Parked {
    node: MockVllm,
    gpu: &'static str,
    request: JoinHandle<reqwest::Result<reqwest::Response>>,
}

/// Parks a request on `node` (labelled `gpu`): closes its gate and sends until one
/// lands there; those that land on the other node complete. Each lands on `node` with
/// probability ½, so 64 tries never all miss in practice.
async fn park(gw: &Gateway, node: &MockVllm, gpu: &'static str) -> Parked {
    node.close_gate();
    let held = node.in_flight() + 1;
    for _ in 0..64 {
        let mut request = tokio::spawn(gw.complete(JSON).send());
        tokio::select! {
            () = node.wait_in_flight(held) => {
                return Parked { node: node.clone(), gpu, request };
            }
            elsewhere = &mut request => {
                let response = elsewhere.unwrap().unwrap();
                assert_eq!(response.status(), 200);
                response.bytes().await.unwrap();
            }
        }
    }
    panic!("64 requests and none landed on {gpu}");
}

impl Parked {
    /// Opens the gate; the held request completes on its node.
    async fn release(self) {
        self.node.open_gate();
        let response = self.request.await.unwrap().unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(gpu(&response), self.gpu);
        response.bytes().await.unwrap();
    }
}

/// One scrape of `GET /metrics`: its sample lines.
struct Scrape(Vec<Sample>);

impl Scrape {
    /// The value of the series with exactly these labels; panics if it is absent.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.0
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
            .unwrap_or_else(|| panic!("no series {name}{labels:?}"))
    }

    /// `fleetgate_upstream_up` of a node of [`MODEL`].
    fn up(&self, gpu: &str) -> f64 {
        self.get("fleetgate_upstream_up", &[("model", MODEL), ("gpu", gpu)])
    }

    fn ejections(&self, gpu: &str) -> f64 {
        self.get(
            "fleetgate_upstream_ejections_total",
            &[("model", MODEL), ("gpu", gpu)],
        )
    }

    fn in_flight(&self, gpu: &str) -> f64 {
        self.get(
            "fleetgate_in_flight_requests",
            &[("model", MODEL), ("gpu", gpu)],
        )
    }

    fn queued(&self) -> f64 {
        self.get("fleetgate_fleet_queued", &[("model", MODEL)])
    }

    /// `fleetgate_upstream_requests_total` by outcome; 0 when never counted.
    fn outcome(&self, gpu: &str, outcome: &str) -> f64 {
        let labels = [("model", MODEL), ("gpu", gpu), ("outcome", outcome)];
        let have = |s: &&Sample| {
            s.name == "fleetgate_upstream_requests_total"
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
        };
        self.0.iter().find(have).map_or(0.0, |s| s.value)
    }
}

async fn scrape(gw: &Gateway) -> Scrape {
    Scrape(parse_metrics(&gw.metrics_text().await))
}

/// Scrapes until `holds` is true of a scrape, for at most `within`; returns how long
/// it took.
async fn wait_metrics(
    gw: &Gateway,
    what: &str,
    within: Duration,
    holds: impl Fn(&Scrape) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if holds(&scrape(gw).await) {
            return start.elapsed();
        }
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_refusing_node_fails_over_and_is_ejected_at_once() {
    let (gw, a, b) = two_nodes(MockConfig::default()).await;
    bounded(async {
        // B holds a request, so the next one goes to A, which now refuses connections.
        let parked = park(&gw, &b, "b").await;
        a.set_failure(FailureMode::Refuse);
        let request = tokio::spawn(gw.complete(JSON).send());
        // It fails over to B (and waits behind B's gate): A is already out of rotation.
        b.wait_in_flight(2).await;
        let during = scrape(&gw).await;
        assert_eq!(during.up("a"), 0.0);
        assert_eq!(during.up("b"), 1.0);
        assert_eq!(during.ejections("a"), 1.0);
        parked.release().await;
        let response = request.await.unwrap().unwrap();
        assert_eq!(response.status(), 200, "the client never sees the refusal");
        assert_eq!(gpu(&response), "b");
        response.bytes().await.unwrap();

        // From the first failure on, B takes everything and every request succeeds.
        for _ in 0..10 {
            assert_eq!(ok_from(&gw).await, "b");
        }
        let after = scrape(&gw).await;
        assert_eq!(after.up("a"), 0.0);
        assert_eq!(after.ejections("a"), 1.0, "one failure, one ejection");
        assert_eq!(after.ejections("b"), 0.0);
        assert_eq!(after.in_flight("a"), 0.0);
        assert_eq!(after.in_flight("b"), 0.0);
        assert!(after.outcome("b", "ok") >= 12.0);
    })
    .await;
}

#[tokio::test]
async fn a_node_answering_500_fails_one_request_with_502_and_stays_out() {
    let (gw, a, b) = two_nodes(MockConfig::default()).await;
    bounded(async {
        let parked = park(&gw, &b, "b").await;
        // The next request goes to A; A fails it once it has it.
        a.close_gate();
        let request = tokio::spawn(gw.complete(JSON).send());
        a.wait_in_flight(1).await;
        let (on_a, on_b) = (completions(&a), completions(&b));
        a.set_failure(FailureMode::Status500);
        a.open_gate();
        let response = request.await.unwrap().unwrap();
        assert_eq!(gpu(&response), "a");
        // A 500 may have started the generation: not retried elsewhere.
        expect_retryable(response, 502, "upstream_error").await;
        let failed = Instant::now();
        assert_eq!(scrape(&gw).await.up("a"), 0.0, "ejected by its failure");
        parked.release().await;
        assert_eq!(completions(&b), on_b, "the 500 was not replayed on B");

        // B takes the traffic at once, and A stays out: its probes get 503 from
        // /health, well past its first back-off (300 ms).
        let mut first_on_b = None;
        let mut served = 0;
        while failed.elapsed() < Duration::from_millis(1200) {
            assert_eq!(ok_from(&gw).await, "b");
            first_on_b.get_or_insert(failed.elapsed());
            served += 1;
        }
        assert!(
            first_on_b.unwrap() < Duration::from_secs(1),
            "{first_on_b:?}"
        );
        assert_eq!(completions(&a), on_a, "A got nothing after its 500");
        let after = scrape(&gw).await;
        assert_eq!(after.up("a"), 0.0);
        assert_eq!(after.ejections("a"), 1.0);
        // The 500 itself (or, if a probe saw A's 503 first, the request cut with it).
        assert_eq!(
            after.outcome("a", "error_status") + after.outcome("a", "unreachable"),
            1.0
        );
        assert!(after.outcome("b", "ok") >= f64::from(served));
    })
    .await;
}

#[tokio::test]
async fn a_hanging_node_fails_its_request_with_502_within_a_second() {
    let (gw, a, b) = two_nodes(MockConfig::default()).await;
    bounded(async {
        let parked = park(&gw, &b, "b").await;
        a.set_failure(FailureMode::Hang);
        let on_a = completions(&a);
        let send = gw.complete(JSON).send();
        let stuck = tokio::spawn(async move { (send.await.unwrap(), Instant::now()) });
        a.wait_in_flight(1).await;
        let wedged = Instant::now();
        parked.release().await;
        // While A sits on its request, B is the lighter node and takes the rest.
        for _ in 0..5 {
            assert_eq!(ok_from(&gw).await, "b");
        }
        // A fails its probe (no answer within 200 ms): the request stuck there is
        // answered 502 instead of hanging, and its connection is closed.
        let (response, answered) = stuck.await.unwrap();
        assert!(
            answered - wedged < Duration::from_secs(1),
            "answered after {:?}",
            answered - wedged
        );
        assert_eq!(gpu(&response), "a");
        expect_retryable(response, 502, "upstream_error").await;
        a.wait_cancelled(1).await;
        for _ in 0..10 {
            assert_eq!(ok_from(&gw).await, "b");
        }
        let after = scrape(&gw).await;
        assert_eq!(after.up("a"), 0.0);
        assert_eq!(after.ejections("a"), 1.0);
        assert_eq!(after.outcome("a", "unreachable"), 1.0);
        assert_eq!(after.in_flight("a"), 0.0);
        assert_eq!(completions(&a), on_a + 1, "nothing more was sent to A");
    })
    .await;
}

#[tokio::test]
async fn a_stream_cut_mid_way_ends_in_an_error_and_is_not_replayed() {
    let (gw, a, b) = two_nodes(MockConfig::default()).await;
    bounded(async {
        let (key_id, key) = gw.create_key(LimitOverrides::default()).await;
        let parked = park(&gw, &b, "b").await;
        let on_b = completions(&b);
        a.set_failure(FailureMode::CutStream { after_chunks: 2 });
        let body = r#"{"model":"llama-8b","prompt":[1,2,3],"max_tokens":10,"stream":true}"#;
        let response = gw.complete_as(&key, body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(gpu(&response), "a");
        let (text, failed) = read_stream(response).await;
        assert!(failed, "the body ends in an error, not cleanly: {text:?}");
        assert!(!text.contains("[DONE]"), "{text:?}");
        let frames = text
            .split("\n\n")
            .filter(|f| f.starts_with("data: {"))
            .count();
        assert_eq!(frames, 2, "the frames sent before the cut arrive: {text:?}");
        parked.release().await;
        assert_eq!(completions(&b), on_b, "the stream was not replayed on B");
        // Charged what was generated: more than the prompt, less than the whole answer.
        gw.wait_occupancy(key_id, 0, 0).await;
        let used = gw.usage(&key).await["used"].as_u64().unwrap();
        assert!(3 < used && used < 3 + 10, "used {used}");
    })
    .await;
}

#[tokio::test]
async fn a_stream_from_a_node_that_stops_answering_is_cut_within_a_second() {
    let (gw, a, b) = two_nodes(MockConfig {
        token_delay: Duration::from_millis(50),
        ..MockConfig::default()
    })
    .await;
    bounded(async {
        let parked = park(&gw, &b, "b").await;
        // 200 tokens at 50 ms: ten seconds of stream, if nothing cuts it.
        let body = r#"{"model":"llama-8b","prompt":[1,2,3],"max_tokens":200,"stream":true}"#;
        let mut response = gw.complete(body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(gpu(&response), "a");
        parked.release().await;
        let first = response.chunk().await.unwrap().expect("a first frame");
        assert!(first.starts_with(b"data: {"));
        a.set_failure(FailureMode::Hang);
        let wedged = Instant::now();
        let (text, failed) = read_stream(response).await;
        assert!(failed, "the body ends in an error, not cleanly");
        assert!(!text.contains("[DONE]"));
        assert!(
            wedged.elapsed() < Duration::from_secs(1),
            "cut after {:?}",
            wedged.elapsed()
        );
        a.wait_cancelled(1).await;
        assert_eq!(ok_from(&gw).await, "b");
        assert_eq!(scrape(&gw).await.up("a"), 0.0);
    })
    .await;
}

#[tokio::test]
async fn a_killed_node_is_readmitted_once_restarted() {
    let (gw, a, b) = two_nodes(MockConfig::default()).await;
    bounded(async {
        // A dies with a request on it, before answering: the request is replayed on B.
        let held = park(&gw, &a, "a").await;
        a.set_failure(FailureMode::Refuse);
        let response = held.request.await.unwrap().unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(gpu(&response), "b");
        response.bytes().await.unwrap();
        a.open_gate();
        // Whichever node each request lands on, B serves it.
        for _ in 0..10 {
            assert_eq!(ok_from(&gw).await, "b");
        }
        wait_metrics(&gw, "A ejected", Duration::from_secs(1), |m| {
            m.up("a") == 0.0
        })
        .await;

        a.set_failure(FailureMode::None);
        // Re-admitted by the first probe after its back-off (300 ms, doubling per failed
        // probe, at most 1 s), a probe interval (100 ms) later at worst.
        let back = wait_metrics(&gw, "A re-admitted", Duration::from_secs(3), |m| {
            m.up("a") == 1.0
        })
        .await;
        assert!(
            back < Duration::from_millis(1500),
            "re-admitted after {back:?}"
        );
        let on_a = completions(&a);
        let parked = park(&gw, &b, "b").await;
        assert_eq!(ok_from(&gw).await, "a", "A takes traffic again");
        parked.release().await;
        assert!(completions(&a) > on_a);
        assert_eq!(scrape(&gw).await.ejections("a"), 1.0);
    })
    .await;
}

#[tokio::test]
async fn with_every_node_down_requests_fail_fast_with_503_until_one_returns() {
    let (gw, a, b) = two_nodes(MockConfig::default()).await;
    bounded(async {
        a.set_failure(FailureMode::Refuse);
        b.set_failure(FailureMode::Refuse);
        unavailable_at_once(&gw).await;
        // The last node is not ejected by a request but by its failed probe.
        wait_metrics(&gw, "both ejected", Duration::from_secs(1), |m| {
            m.up("a") == 0.0 && m.up("b") == 0.0
        })
        .await;
        unavailable_at_once(&gw).await;

        b.set_failure(FailureMode::None);
        wait_metrics(&gw, "B re-admitted", Duration::from_secs(3), |m| {
            m.up("b") == 1.0
        })
        .await;
        assert_eq!(ok_from(&gw).await, "b");
    })
    .await;
}

/// One node that runs at most one request at a time, with `fleet` settings added.
async fn one_slot(fleet: &str) -> Gateway {
    let mock = node(MockConfig::default()).await;
    gateway(fleet, &[(&mock, "gpu-a", "max_in_flight = 1")]).await
}

/// Takes the one slot of [`one_slot`]'s node: a request held there behind its closed gate.
async fn take_the_slot(gw: &Gateway) -> JoinHandle<reqwest::Result<reqwest::Response>> {
    gw.mock.close_gate();
    let first = tokio::spawn(gw.complete(JSON).send());
    gw.mock.wait_in_flight(1).await;
    first
}

/// Opens the gate: the request holding the slot completes, the only one the node got.
async fn release_the_slot_alone(
    gw: &Gateway,
    first: JoinHandle<reqwest::Result<reqwest::Response>>,
) {
    gw.mock.open_gate();
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    assert_eq!(completions(&gw.mock), 1);
}

/// Sends [`JSON`]: when it was sent, and the response.
async fn send_timed(gw: &Gateway) -> (Instant, reqwest::Response) {
    let start = Instant::now();
    (start, gw.complete(JSON).send().await.unwrap())
}

/// Sends [`JSON`] and expects a retryable 503, whole within a second.
async fn unavailable_at_once(gw: &Gateway) {
    let (start, response) = send_timed(gw).await;
    expect_retryable(response, 503, "upstream_unavailable").await;
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn a_request_beyond_max_in_flight_waits_for_a_free_slot() {
    let gw = one_slot("").await;
    bounded(async {
        let first = take_the_slot(&gw).await;
        let second = tokio::spawn(gw.complete(JSON).send());
        wait_metrics(&gw, "queued", Duration::from_secs(5), |m| m.queued() == 1.0).await;
        assert_eq!(scrape(&gw).await.in_flight("gpu-a"), 1.0);
        assert_eq!(gw.mock.in_flight(), 1, "the second is not sent yet");
        gw.mock.open_gate();
        for request in [first, second] {
            let response = request.await.unwrap().unwrap();
            assert_eq!(response.status(), 200);
            response.bytes().await.unwrap();
        }
        assert_eq!(completions(&gw.mock), 2);
        let after = scrape(&gw).await;
        assert_eq!(after.queued(), 0.0);
        assert_eq!(after.in_flight("gpu-a"), 0.0);
        assert_eq!(after.outcome("gpu-a", "ok"), 2.0);
        assert_eq!(
            after.get(
                "fleetgate_upstream_duration_seconds_count",
                &[("model", MODEL), ("gpu", "gpu-a")]
            ),
            2.0
        );
    })
    .await;
}

#[tokio::test]
async fn with_no_queue_room_a_request_beyond_max_in_flight_gets_503_at_once() {
    let gw = one_slot("queue_size = 0").await;
    bounded(async {
        let first = take_the_slot(&gw).await;
        // Not after the queue timeout (30 s by default): there is no room to wait in.
        unavailable_at_once(&gw).await;
        release_the_slot_alone(&gw, first).await;
    })
    .await;
}

#[tokio::test]
async fn a_queued_request_gets_503_after_the_queue_timeout() {
    let gw = one_slot("queue_timeout_ms = 300").await;
    bounded(async {
        let first = take_the_slot(&gw).await;
        let (start, response) = send_timed(&gw).await;
        let waited = start.elapsed();
        expect_retryable(response, 503, "upstream_unavailable").await;
        assert!(
            Duration::from_millis(300) <= waited && waited < Duration::from_secs(1),
            "gave up after {waited:?}"
        );
        assert_eq!(scrape(&gw).await.queued(), 0.0);
        release_the_slot_alone(&gw, first).await;
    })
    .await;
}

#[tokio::test]
async fn a_request_counting_its_tokens_on_a_hanging_node_does_not_hang() {
    // A small context keeps the default max_tokens (what fits in it) small.
    let small = MockConfig {
        max_model_len: 64,
        ..MockConfig::default()
    };
    let (a, b) = (node(small.clone()).await, node(small).await);
    let gw = gateway("", &[(&a, "a", ""), (&b, "b", "")]).await;
    bounded(async {
        a.set_failure(FailureMode::Hang);
        // Without max_tokens, the gateway counts a text prompt's tokens on one of the
        // nodes that are up (A with probability ½) to fit the default in the context.
        let body = r#"{"model":"llama-8b","prompt":"Once upon a time"}"#;
        let requests: Vec<_> = (0..16)
            .map(|_| {
                let send = gw.complete(body).send();
                tokio::spawn(tokio::time::timeout(Duration::from_secs(2), send))
            })
            .collect();
        for request in requests {
            let response = request
                .await
                .unwrap()
                .expect("an answer within 2 s")
                .unwrap();
            // Served by B, or failed by A once it is found dead.
            let status = response.status().as_u16();
            assert!(status == 200 || status == 502, "status {status}");
        }
    })
    .await;
}
