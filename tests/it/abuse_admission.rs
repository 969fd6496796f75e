//! Admission before work: a request its key's rate or full queue refuses costs the
//! fleet nothing. Counting a text prompt's tokens runs the node's tokenizer, on the
//! node that serves everyone; a key over its limits must not make it count.

use std::time::Duration;

use crate::common::{Gateway, MODEL, expect_error};
use fleetgate::store::LimitOverrides;
use serde_json::json;

const TEST_LIMIT: Duration = Duration::from_secs(30);

/// A request whose planning counts its prompt: without `max_tokens`, the room left in
/// the context is the default, and that needs the prompt's exact length.
fn counted_request() -> String {
    json!({"model": MODEL, "prompt": "A prompt whose tokens the node has to count"}).to_string()
}

/// The `/tokenize` calls the node has answered so far.
fn tokenize_calls(gw: &Gateway) -> usize {
    gw.mock
        .received()
        .iter()
        .filter(|r| r.path == "/tokenize")
        .count()
}

#[tokio::test]
async fn requests_over_the_rate_are_refused_before_their_prompt_is_counted() {
    tokio::time::timeout(TEST_LIMIT, async {
        let gw = Gateway::start().await;
        let (_, key) = gw
            .create_key(LimitOverrides {
                requests_per_minute: Some(2),
                ..LimitOverrides::default()
            })
            .await;
        let mut statuses = Vec::new();
        for _ in 0..10 {
            let response = gw
                .complete_as(&key, &counted_request())
                .send()
                .await
                .unwrap();
            statuses.push(response.status().as_u16());
            if response.status() == 429 {
                expect_error(response, 429, "rate_limited").await;
            } else {
                response.bytes().await.unwrap();
            }
        }
        assert_eq!(statuses, [200, 200, 429, 429, 429, 429, 429, 429, 429, 429]);
        assert_eq!(
            tokenize_calls(&gw),
            2,
            "the node counted prompts of requests the rate refused"
        );
    })
    .await
    .expect("the test hung");
}

#[tokio::test]
async fn requests_the_full_queue_refuses_are_refused_before_their_prompt_is_counted() {
    tokio::time::timeout(TEST_LIMIT, async {
        let gw = Gateway::start().await;
        let (id, key) = gw.key_with_slots(1, Some(0)).await;
        // One request runs, held at the node; the key has no queue.
        gw.mock.close_gate();
        let running = tokio::spawn(gw.complete_as(&key, &counted_request()).send());
        gw.wait_occupancy(id, 1, 0).await;
        assert_eq!(tokenize_calls(&gw), 1);
        for _ in 0..5 {
            let response = gw
                .complete_as(&key, &counted_request())
                .send()
                .await
                .unwrap();
            expect_error(response, 429, "queue_full").await;
        }
        assert_eq!(
            tokenize_calls(&gw),
            1,
            "the node counted prompts of requests the full queue refused"
        );
        gw.mock.open_gate();
        assert_eq!(running.await.unwrap().unwrap().status(), 200);
    })
    .await
    .expect("the test hung");
}
