//! Aborted work is charged: a non-streaming request whose client leaves, and a running
//! job that is cancelled, cost the GPU what it generated until then, and the key is
//! charged for that (within ±50 %), not only for its prompt.

use std::time::Duration;

use crate::common::{Gateway, MODEL};
use fleetgate::store::LimitOverrides;
use mock_vllm::MockConfig;
use serde_json::{Value, json};

const TEST_LIMIT: Duration = Duration::from_secs(30);
/// The node decodes a token every 5 ms: 200 a second.
const TOKEN_DELAY: Duration = Duration::from_millis(5);
/// How long the client lets the node work before it leaves: ~200 tokens.
const PATIENCE: Duration = Duration::from_secs(1);
/// Three token ids: the prompt of every request here.
const PROMPT_TOKENS: u64 = 3;

fn request(max_tokens: u64) -> String {
    json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": max_tokens}).to_string()
}

/// A gateway in front of a node at 200 tokens a second, and a key of its own; the
/// node's speed learned from a few whole answers, as any busy gateway has.
async fn warmed_up() -> (Gateway, i64, String) {
    let gw = Gateway::start_with(
        MockConfig {
            token_delay: TOKEN_DELAY,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    let (id, key) = gw.create_key(LimitOverrides::default()).await;
    for _ in 0..3 {
        let response = gw.complete_as(&key, &request(40)).send().await.unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    (gw, id, key)
}

/// The key's used tokens once nothing of it runs or waits any more.
async fn used_when_idle(gw: &Gateway, id: i64, key: &str) -> u64 {
    gw.wait_occupancy(id, 0, 0).await;
    gw.usage(key).await["used"].as_u64().unwrap()
}

/// Completion tokens charged for the abort, against the ~200 the node generated.
fn assert_charged_for_the_work(before: u64, after: u64) {
    let completion = after - before - PROMPT_TOKENS;
    assert!(
        (100..=400).contains(&completion),
        "charged {completion} completion tokens for ~200 generated"
    );
}

#[tokio::test]
async fn a_client_that_leaves_a_whole_answer_is_charged_what_was_generated() {
    tokio::time::timeout(TEST_LIMIT, async {
        let (gw, id, key) = warmed_up().await;
        let before = used_when_idle(&gw, id, &key).await;
        // 1,000 tokens take the node 5 s; the client gives up after one.
        let gone = gw
            .complete_as(&key, &request(1000))
            .timeout(PATIENCE)
            .send()
            .await;
        assert!(gone.is_err_and(|e| e.is_timeout()));
        gw.mock.wait_cancelled(1).await;
        assert_charged_for_the_work(before, used_when_idle(&gw, id, &key).await);
    })
    .await
    .expect("the test hung");
}

#[tokio::test]
async fn a_running_job_that_is_cancelled_is_charged_what_was_generated() {
    tokio::time::timeout(TEST_LIMIT, async {
        let (gw, id, key) = warmed_up().await;
        let before = used_when_idle(&gw, id, &key).await;
        let submitted = gw
            .complete_as(&key, &request(1000))
            .header("prefer", "respond-async")
            .send()
            .await
            .unwrap();
        assert_eq!(submitted.status(), 202);
        let job: Value = submitted.json().await.unwrap();
        let job_id = job["id"].as_str().unwrap();
        gw.mock.wait_in_flight(1).await;
        // The researcher cancels it a second into its run.
        tokio::time::sleep(PATIENCE).await;
        let cancelled = gw
            .client
            .delete(format!("{}/v1/harvest/{job_id}", gw.url))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        assert!(cancelled.status().is_success(), "{}", cancelled.status());
        gw.mock.wait_cancelled(1).await;
        assert_charged_for_the_work(before, used_when_idle(&gw, id, &key).await);
    })
    .await
    .expect("the test hung");
}
