//! Prefix-cache-aware routing (`fleet.routing = "prefix"`): the node that owns a prompt's
//! prefix gets it, on every replica; an overloaded, full or ejected owner is passed over,
//! and an ejected one gets its prefixes back once it recovers.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::{Duration, Instant};

use crate::common::{Gateway, MODEL, node, parse_metrics};
use mock_vllm::{FailureMode, MockConfig, MockVllm};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

const PREFIX: &str = "[fleet]\nrouting = \"prefix\"";
const GPUS: [&str; 4] = ["a", "b", "c", "d"];
/// No test may take longer than this.
const TEST_LIMIT: Duration = Duration::from_secs(30);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .expect("the test finished in time")
}

async fn nodes(n: usize, config: MockConfig) -> Vec<MockVllm> {
    let mut nodes = Vec::new();
    for _ in 0..n {
        nodes.push(node(config.clone()).await);
    }
    nodes
}

async fn gateway(fleet: &str, nodes: &[MockVllm], upstream_keys: &str) -> Gateway {
    let entries: Vec<_> = nodes
        .iter()
        .zip(GPUS)
        .map(|(mock, gpu)| (mock, gpu, upstream_keys))
        .collect();
    Gateway::start_fleet(fleet, "", &entries).await
}

/// A ~1.6 KiB document, distinct from its first bytes on.
fn document(i: usize) -> String {
    format!("Document {i}. ") + &"The quick brown fox jumps over the lazy dog. ".repeat(36)
}

/// ~1.6 KiB of token ids, distinct from the first id on.
fn token_document(i: usize) -> Vec<u64> {
    std::iter::once(1000 + i as u64)
        .chain((0..400).map(|j| 2000 + j))
        .collect()
}

/// Sends a completion and returns the GPU label of the node that served it.
async fn served_by(gw: &Gateway, prompt: Value) -> String {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let response = gw.complete(&body.to_string()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let gpu = response.headers()["x-acs-upstream-gpu"]
        .to_str()
        .unwrap()
        .to_owned();
    response.bytes().await.unwrap();
    gpu
}

/// `fleetgate_routing_decisions_total` of [`MODEL`] by outcome.
async fn decisions(gw: &Gateway) -> BTreeMap<String, f64> {
    parse_metrics(&gw.metrics_text().await)
        .into_iter()
        .filter(|s| s.name == "fleetgate_routing_decisions_total" && s.labels["model"] == MODEL)
        .map(|s| (s.labels["outcome"].clone(), s.value))
        .collect()
}

fn counts(owner: f64, runner_up: f64, fallback: f64, none: f64) -> BTreeMap<String, f64> {
    [
        ("owner", owner),
        ("runner_up", runner_up),
        ("fallback_load", fallback),
        ("no_owner", none),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// The first prompt of each completion a node received, as JSON.
fn first_prompts(mock: &MockVllm) -> Vec<Value> {
    mock.received()
        .into_iter()
        .filter(|r| r.path == "/v1/completions")
        .map(|r| match &r.json()["prompt"] {
            Value::Array(items) if items.first().is_some_and(|f| !f.is_number()) => {
                items[0].clone()
            }
            prompt => prompt.clone(),
        })
        .collect()
}

#[tokio::test]
async fn replicas_send_each_prefix_to_the_same_node() {
    let nodes = nodes(4, MockConfig::default()).await;
    // Two replicas that share nothing but their configuration.
    let replicas = [
        gateway(PREFIX, &nodes, "").await,
        gateway(PREFIX, &nodes, "").await,
    ];
    bounded(async {
        // Each replica sees each prefix once first: a new prefix avoids an owner that
        // is any busier than the lightest node, and the last request's slot may not be
        // given back yet. Its node is not counted below.
        for gw in &replicas {
            for i in 0..8 {
                served_by(gw, json!(document(i))).await;
                served_by(gw, json!(token_document(i))).await;
            }
        }
        let introduced: Vec<usize> = nodes.iter().map(|mock| first_prompts(mock).len()).collect();
        for (r, gw) in replicas.iter().enumerate() {
            for i in 0..8 {
                for branch in 0..3 {
                    let text = format!("{} Branch {r}.{branch}:", document(i));
                    served_by(gw, json!(text)).await;
                    let mut ids = token_document(i);
                    ids.push(branch);
                    served_by(gw, json!(ids)).await;
                }
                // A batch goes where its first prompt goes, and counts once.
                served_by(gw, json!([document(i), "an unrelated second prompt"])).await;
            }
            served_by(gw, json!("too short to have an owner")).await;
            let counted = decisions(gw).await;
            assert!(counted["owner"] >= 56.0, "{counted:?}");
            assert_eq!(counted["owner"] + counted["runner_up"], 56.0 + 16.0);
            assert_eq!((counted["fallback_load"], counted["no_owner"]), (0.0, 1.0));
        }
        let mut owners = BTreeSet::new();
        for i in 0..8 {
            let text = document(i);
            let on_nodes = |wanted: &dyn Fn(&Value) -> bool| -> Vec<usize> {
                let since_introduced = nodes.iter().zip(&introduced);
                since_introduced
                    .map(|(mock, &skip)| {
                        let prompts = first_prompts(mock);
                        prompts[skip..].iter().filter(|p| wanted(p)).count()
                    })
                    .collect()
            };
            let texts = on_nodes(&|p: &Value| p.as_str().is_some_and(|s| s.starts_with(&text)));
            let tokens = on_nodes(&|p: &Value| p[0] == json!(1000 + i));
            for (form, per_node) in [("text", texts), ("token ids", tokens)] {
                let expected = if form == "text" { 8 } else { 6 };
                let holders: Vec<_> = (0..4).filter(|&n| per_node[n] > 0).collect();
                assert_eq!(holders.len(), 1, "document {i} as {form}: {per_node:?}");
                assert_eq!(per_node[holders[0]], expected, "document {i} as {form}");
                owners.insert(holders[0]);
            }
        }
        assert!(
            owners.len() >= 2,
            "prefixes spread over the nodes: {owners:?}"
        );
    })
    .await;
}

/// Streams of [`document`] 0 held behind the nodes' closed gates.
struct Held<'a> {
    nodes: &'a [MockVllm],
    requests: Vec<JoinHandle<reqwest::Response>>,
}

impl<'a> Held<'a> {
    fn new(nodes: &'a [MockVllm]) -> Self {
        for mock in nodes {
            mock.close_gate();
        }
        Self {
            nodes,
            requests: Vec::new(),
        }
    }

    /// Sends one more and waits until a node holds it.
    async fn send(&mut self, gw: &Gateway) {
        let body = json!({"model": MODEL, "prompt": document(0), "max_tokens": 2, "stream": true});
        let request = gw.complete(&body.to_string());
        self.requests
            .push(tokio::spawn(async move { request.send().await.unwrap() }));
        let n = self.requests.len();
        while self.in_flight().iter().sum::<usize>() < n {
            let next = self
                .nodes
                .iter()
                .map(|mock| Box::pin(mock.wait_in_flight(mock.in_flight() + 1)));
            futures_util::future::select_all(next).await;
        }
    }

    fn in_flight(&self) -> Vec<usize> {
        self.nodes.iter().map(MockVllm::in_flight).collect()
    }

    async fn release(self) {
        for mock in self.nodes {
            mock.open_gate();
        }
        for request in self.requests {
            assert_eq!(request.await.unwrap().status(), 200);
        }
    }
}

#[tokio::test]
async fn an_overloaded_owner_sheds_to_its_runner_up_then_to_the_least_loaded_node() {
    let nodes = nodes(3, MockConfig::default()).await;
    let fleet = format!("{PREFIX}\nprefix_imbalance_abs = 2\nprefix_imbalance_rel = 1.5");
    let gw = gateway(&fleet, &nodes, "").await;
    bounded(async {
        let mut held = Held::new(&nodes);
        for _ in 0..7 {
            held.send(&gw).await;
        }
        // A node takes requests until it is more than 2 above the idle one (and more
        // than 1.5 times its load): the owner 3, then the runner-up 3, then the 7th
        // goes by load.
        assert_eq!(decisions(&gw).await, counts(3.0, 3.0, 1.0, 0.0));
        let mut split = held.in_flight();
        split.sort_unstable();
        assert!(split == [1, 3, 3] || split == [0, 3, 4], "{split:?}");
        held.release().await;
    })
    .await;
}

#[tokio::test]
async fn an_owner_at_max_in_flight_is_passed_over_for_its_runner_up() {
    let nodes = nodes(2, MockConfig::default()).await;
    let gw = gateway(PREFIX, &nodes, "max_in_flight = 1").await;
    bounded(async {
        let mut held = Held::new(&nodes);
        held.send(&gw).await;
        held.send(&gw).await;
        assert_eq!(held.in_flight(), [1, 1]);
        assert_eq!(decisions(&gw).await, counts(1.0, 1.0, 0.0, 0.0));
        held.release().await;
    })
    .await;
}

/// Scrapes `/metrics` until `holds`, for at most 10 s.
async fn wait_metrics(gw: &Gateway, what: &str, holds: impl Fn(&str) -> bool) {
    let start = Instant::now();
    loop {
        if holds(&gw.metrics_text().await) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn an_ejected_owners_prefixes_go_to_one_other_node_and_come_back() {
    let nodes = nodes(3, MockConfig::default()).await;
    let fleet = format!(
        "{PREFIX}\nprobe_interval_ms = 50\nprobe_timeout_ms = 200\neject_base_ms = 100\neject_max_ms = 200"
    );
    let gw = gateway(&fleet, &nodes, "").await;
    bounded(async {
        let prompt = || json!(format!("{} A branch.", document(7)));
        let owner = served_by(&gw, prompt()).await;
        let index = GPUS.iter().position(|g| *g == owner).unwrap();
        nodes[index].set_failure(FailureMode::Refuse);
        // The first request finds the owner refusing, fails over and ejects it; every
        // one after goes to the same runner-up, which now holds the prefix.
        let mut during = BTreeSet::new();
        for _ in 0..4 {
            during.insert(served_by(&gw, prompt()).await);
        }
        assert_eq!(during.len(), 1, "one other node: {during:?}");
        assert!(!during.contains(&owner));

        nodes[index].set_failure(FailureMode::None);
        let up = format!("fleetgate_upstream_up{{model=\"{MODEL}\",gpu=\"{owner}\"}} 1");
        wait_metrics(&gw, "the owner is re-admitted", |text| text.contains(&up)).await;
        assert_eq!(served_by(&gw, prompt()).await, owner, "back to its owner");
    })
    .await;
}

#[tokio::test]
async fn the_nodes_prefix_cache_hit_rate_is_a_gauge() {
    let nodes = nodes(
        1,
        MockConfig {
            prefix_cache_tokens: 4096,
            ..MockConfig::default()
        },
    )
    .await;
    let gw = gateway(&format!("{PREFIX}\nprobe_interval_ms = 50"), &nodes, "").await;
    bounded(async {
        for _ in 0..2 {
            served_by(&gw, json!(document(1))).await;
        }
        wait_metrics(&gw, "a hit rate above 0", |text| {
            parse_metrics(text).iter().any(|s| {
                s.name == "fleetgate_upstream_prefix_cache_hit_rate"
                    && s.labels["gpu"] == "a"
                    && s.value > 0.0
                    && s.value <= 1.0
            })
        })
        .await;
    })
    .await;
}
