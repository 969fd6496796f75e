//! Several vLLM nodes behind one model: load follows each node's speed.

use std::time::Duration;

use crate::common::{self, Gateway, MODEL};
use futures_util::StreamExt;
use mock_vllm::{MockConfig, MockVllm};

async fn node(token_delay_ms: u64) -> MockVllm {
    common::node(MockConfig {
        token_delay: Duration::from_millis(token_delay_ms),
        ..MockConfig::default()
    })
    .await
}

fn completions(mock: &MockVllm) -> usize {
    mock.received()
        .iter()
        .filter(|r| r.path == "/v1/completions")
        .count()
}

#[tokio::test]
async fn the_faster_node_takes_more_of_the_load() {
    let fast = node(0).await;
    let slow = node(40).await;
    let gw = Gateway::start_fleet("", "", &[(&fast, "fast", ""), (&slow, "slow", "")]).await;
    let body =
        serde_json::json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 10}).to_string();
    // Four clients, twelve requests each: a request on the slow node takes ~400 ms, on
    // the fast one a few ms.
    futures_util::stream::iter(0..48)
        .for_each_concurrent(4, |_| async {
            let response = gw.complete(&body).send().await.unwrap();
            assert_eq!(response.status(), 200);
            response.bytes().await.unwrap();
        })
        .await;
    let (on_fast, on_slow) = (completions(&fast), completions(&slow));
    assert_eq!(on_fast + on_slow, 48);
    assert!(on_slow >= 1, "both nodes are used");
    assert!(on_fast >= 4 * on_slow, "fast {on_fast}, slow {on_slow}");
}

#[tokio::test]
async fn weights_share_the_load_of_equal_nodes() {
    let (a, b) = (node(20).await, node(20).await);
    let gw = Gateway::start_fleet("", "", &[(&a, "a", "weight = 3"), (&b, "b", "")]).await;
    let body =
        serde_json::json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5, "stream": true})
            .to_string();
    // Eight held at once: with weights 3:1 the in-flight split is 6:2.
    a.close_gate();
    b.close_gate();
    let requests: Vec<_> = (0..8)
        .map(|_| {
            let request = gw.complete(&body);
            tokio::spawn(async move { request.send().await.unwrap().text().await.unwrap() })
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(10), async {
        while a.in_flight() + b.in_flight() < 8 {
            tokio::select! {
                () = a.wait_in_flight(a.in_flight() + 1) => {},
                () = b.wait_in_flight(b.in_flight() + 1) => {},
            }
        }
    })
    .await
    .unwrap();
    let (on_a, on_b) = (a.in_flight(), b.in_flight());
    a.open_gate();
    b.open_gate();
    for request in requests {
        request.await.unwrap();
    }
    assert!(on_a > on_b, "weight 3 took {on_a}, weight 1 took {on_b}");
}
