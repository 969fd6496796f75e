//! Knowing when to hold (`fleet.hold`): a node without `max_in_flight` that runs at most
//! four requests at once (mock-vllm's `max_num_seqs`). Once it has reported requests
//! waiting, the gateway keeps the excess in its fleet queue instead of sending it to
//! the node's own; with `hold = "off"` everything goes to the node.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::common::{Gateway, MODEL, node, parse_metrics};
use mock_vllm::{MockConfig, MockVllm};
use tokio::task::JoinHandle;

/// 100 tokens, 20 ms apart: each request holds its place in the batch for ~2 s.
const LONG: &str = r#"{"model":"llama-8b","prompt":[1,2,3],"max_tokens":100}"#;

/// A request sent, its answer to come.
type Sent = JoinHandle<reqwest::Result<reqwest::Response>>;

/// The node's batch.
const BATCH: usize = 4;

/// No test may take longer than this.
const TEST_LIMIT: Duration = Duration::from_secs(60);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .expect("the test hung")
}

/// A gateway in front of one node of batch [`BATCH`], probed every 100 ms, with `fleet`
/// added to its `[fleet]` table.
async fn gateway(fleet: &str) -> Gateway {
    let mock = node(MockConfig {
        max_num_seqs: Some(BATCH as u32),
        token_delay: Duration::from_millis(20),
        ..MockConfig::default()
    })
    .await;
    let top_level = format!(
        "[fleet]\nprobe_interval_ms = 100\nprobe_timeout_ms = 1000\n{fleet}\n[limits]\nrequests_per_minute = 1000000\n"
    );
    Gateway::start_fleet(&top_level, "", &[(&mock, "gpu-a", "")]).await
}

fn send(gw: &Gateway, n: usize) -> Vec<Sent> {
    (0..n)
        .map(|_| tokio::spawn(gw.complete(LONG).send()))
        .collect()
}

/// Polls `what` every 10 ms until it holds, for at most 10 s.
async fn wait_for(what: &str, mut holds: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !holds().await {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what}: not within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A series of the gateway's `/metrics` for [`MODEL`] (and `gpu-a`, for a node's).
async fn gauge(gw: &Gateway, name: &str) -> Option<f64> {
    let text = gw.metrics_text().await;
    parse_metrics(&text)
        .into_iter()
        .find(|s| {
            s.name == name
                && s.labels.get("model").is_some_and(|m| m == MODEL)
                && s.labels.get("gpu").is_none_or(|g| g == "gpu-a")
        })
        .map(|s| s.value)
}

async fn queued(gw: &Gateway) -> f64 {
    gauge(gw, "fleetgate_fleet_queued").await.unwrap_or(0.0)
}

async fn hold_limit(gw: &Gateway) -> Option<f64> {
    gauge(gw, "fleetgate_upstream_hold_limit").await
}

/// Five requests on the node: four run, one waits in its queue.
async fn fill_the_batch_and_one(gw: &Gateway) -> Vec<Sent> {
    let first = send(gw, BATCH + 1);
    let mock = gw.mock.clone();
    wait_for("4 running, 1 waiting on the node", async || {
        (mock.running(), mock.waiting()) == (BATCH, 1)
    })
    .await;
    first
}

/// Waits for every request; each must succeed.
async fn all_complete(requests: Vec<Sent>) {
    for request in requests {
        let response = request.await.unwrap().unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
}

/// The most the node reported waiting while `requests` ran.
async fn most_waiting_until_done(mock: &MockVllm, requests: Vec<Sent>) -> usize {
    let done = tokio::spawn(all_complete(requests));
    let mut most = 0;
    while !done.is_finished() {
        most = most.max(mock.waiting());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    done.await.unwrap();
    most
}

#[tokio::test]
async fn once_the_node_queues_the_gateway_holds_the_excess() {
    let gw = gateway("").await;
    bounded(async {
        let started = Instant::now();
        let mut requests = fill_the_batch_and_one(&gw).await;
        // A reading of 5 in flight, 4 running and 1 waiting: a limit of 4.
        wait_for("a limit learned", async || hold_limit(&gw).await == Some(4.0)).await;
        let learned = started.elapsed();
        requests.extend(send(&gw, 7));
        wait_for("the seven held", async || queued(&gw).await == 7.0).await;
        assert_eq!(gw.mock.in_flight(), BATCH + 1, "none of them sent");
        assert!(gw.mock.waiting() <= 1);
        let most_waiting = most_waiting_until_done(&gw.mock, requests).await;
        eprintln!(
            "limit learned after {learned:?}; at most {most_waiting} waiting on the node; all 12 done after {:?}",
            started.elapsed()
        );
        assert!(
            most_waiting <= 2,
            "the node had {most_waiting} waiting: the gateway sent beyond what it runs"
        );
        assert_eq!(queued(&gw).await, 0.0);
        let received = gw.mock.received().len();
        assert_eq!(received, 12);
    })
    .await;
}

#[tokio::test]
async fn with_hold_off_everything_goes_to_the_node() {
    let gw = gateway("hold = \"off\"").await;
    bounded(async {
        let mut requests = fill_the_batch_and_one(&gw).await;
        // Two readings later (the second began after the first was answered), the
        // gateway has seen the queue.
        let read = gw.mock.metrics_read();
        let mock = gw.mock.clone();
        wait_for("a reading of the queue", async || {
            mock.metrics_read() >= read + 2
        })
        .await;
        assert_eq!(hold_limit(&gw).await, None);
        requests.extend(send(&gw, 7));
        wait_for("all twelve on the node, 8 waiting", async || {
            (mock.running(), mock.waiting()) == (BATCH, 8)
        })
        .await;
        assert_eq!(queued(&gw).await, 0.0);
        assert_eq!(hold_limit(&gw).await, None);
        all_complete(requests).await;
    })
    .await;
}
