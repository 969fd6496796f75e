//! Distrust of nodes: a buggy or hostile vLLM server cannot make the gateway buffer
//! without bound, stream past what a request allows, or charge a key beyond its
//! reservation. Each test plays one such node (mock-vllm's `Endless`, `Overgenerate`
//! and `AbsurdUsage` modes) and checks what the other users of the gateway would
//! notice: memory read from the node, the client's answer, the key's usage and the
//! node's place in rotation.

use std::time::Duration;

use crate::common::{Gateway, MODEL, expect_error, node};
use fleetgate::admission::Month;
use fleetgate::keys::KeyService;
use mock_vllm::{FailureMode, MockConfig, MockVllm};
use serde_json::{Value, json};

/// More than any bounded read of the gateway plus what the sockets between it and the
/// node can hold; far less than what an unbounded read takes in a second.
const READ_AT_MOST: u64 = 16 * 1024 * 1024;

/// No test may take longer than this; a hang fails the test instead of stalling it.
const TEST_LIMIT: Duration = Duration::from_secs(30);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .expect("the test hung")
}

/// A gateway in front of `mock` alone, whose prober asks only every minute (so that what
/// a test sees comes from its own requests) but would wait `probe_timeout_ms` for a
/// whole answer.
async fn lone_node(mock: &MockVllm, probe_timeout_ms: u64) -> Gateway {
    let fleet =
        format!("[fleet]\nprobe_interval_ms = 60000\nprobe_timeout_ms = {probe_timeout_ms}\n");
    Gateway::start_fleet(&fleet, "", &[(mock, "gpu-a", "")]).await
}

/// The node's entry in verbose `/health`.
async fn node_health(gw: &Gateway) -> Value {
    let health = gw.get_json("/health?verbose=true").await;
    health["models"][0]["upstreams"][0].clone()
}

/// The key's used tokens this month as `/v1/usage` and the ledger (`keys usage`) tell
/// them, once the ledger has what was settled.
async fn used_both_ways(gw: &Gateway) -> (u64, u64) {
    let live = gw.usage(&gw.key).await["used"].as_u64().unwrap();
    gw.state.ledger().flush().await;
    let id = fleetgate::key_secret::parse_bearer(&gw.key)
        .unwrap()
        .0
        .to_owned();
    let ledger = KeyService::new(gw.state.store(), &gw.state.config().limits)
        .usage(&id, Month::now())
        .await
        .unwrap()
        .used;
    (live, ledger)
}

#[tokio::test]
async fn a_node_whose_model_list_never_ends_is_read_only_up_to_a_bound() {
    bounded(async {
        let mock = node(MockConfig::default()).await;
        mock.set_failure(FailureMode::Endless);
        // Start-up asks the node what it serves, for up to 10 s.
        let gw = lone_node(&mock, 10_000).await;
        let sent = mock.endless_bytes_sent();
        assert!(
            sent < READ_AT_MOST,
            "the gateway read {sent} bytes of a never-ending /v1/models"
        );
        let health = node_health(&gw).await;
        assert_eq!(health["up"], false, "{health}");
        assert_eq!(health["down_reason"], "probe_failed", "{health}");
    })
    .await;
}

#[tokio::test]
async fn a_tokenizer_answer_that_never_ends_fails_the_request_at_a_bound() {
    bounded(async {
        let mock = node(MockConfig::default()).await;
        let gw = lone_node(&mock, 10_000).await;
        mock.set_failure(FailureMode::Endless);
        // Without max_tokens the gateway counts the prompt to know the room left.
        let body = json!({"model": MODEL, "prompt": "Counting these words needs the tokenizer"});
        let response = gw.complete(&body.to_string()).send().await.unwrap();
        expect_error(response, 502, "upstream_error").await;
        let sent = mock.endless_bytes_sent();
        assert!(
            sent < READ_AT_MOST,
            "the gateway read {sent} bytes of a never-ending /tokenize answer"
        );
    })
    .await;
}

#[tokio::test]
async fn a_stream_past_max_tokens_is_cut_charged_at_most_its_reservation_and_its_node_ejected() {
    bounded(async {
        let mock = node(MockConfig::default()).await;
        let gw = lone_node(&mock, 1_000).await;
        mock.set_failure(FailureMode::Overgenerate);
        let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 16, "stream": true});
        let mut response = gw.complete(&body.to_string()).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let (mut relayed, mut cut) = (Vec::new(), false);
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => relayed.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(_) => {
                    cut = true;
                    break;
                }
            }
        }
        assert!(cut, "the stream ended as if complete");
        let frames = String::from_utf8(relayed)
            .unwrap()
            .matches("data: {")
            .count();
        assert!(
            frames <= 17,
            "{frames} token frames relayed for max_tokens 16"
        );
        // The reservation: 3 prompt tokens + 16.
        let (live, ledger) = used_both_ways(&gw).await;
        assert!((1..=19).contains(&live), "charged {live} tokens");
        assert_eq!(live, ledger, "/v1/usage and the ledger disagree");
        let health = node_health(&gw).await;
        assert_eq!(health["up"], false, "{health}");
        assert_eq!(health["down_reason"], "misbehaved", "{health}");
    })
    .await;
}

#[tokio::test]
async fn absurd_usage_is_charged_at_most_the_reservation_and_ejects_the_node() {
    bounded(async {
        let mock = node(MockConfig::default()).await;
        let gw = lone_node(&mock, 1_000).await;
        mock.set_failure(FailureMode::AbsurdUsage);
        let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4});
        let response = gw.complete(&body.to_string()).send().await.unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
        // The reservation: 3 prompt tokens + 4.
        let (live, ledger) = used_both_ways(&gw).await;
        assert!((1..=7).contains(&live), "charged {live} tokens");
        assert_eq!(live, ledger, "/v1/usage and the ledger disagree");
        let health = node_health(&gw).await;
        assert_eq!(health["down_reason"], "misbehaved", "{health}");
        assert_eq!(
            gw.usage(&gw.key).await["remaining"],
            gw.state.config().limits.monthly_budget - live,
            "the budget lost only what was charged"
        );
    })
    .await;
}
