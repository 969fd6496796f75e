//! One metadata row per request ("Request log" in docs/operations.md): who, what, how it
//! went — and never the prompt or the completion.

use crate::common::{Gateway, MODEL};

const PROMPT: &str = "PRIVATE-PROMPT-TEXT-4711";

#[tokio::test]
async fn every_request_gets_one_metadata_row_without_text() {
    let gw = Gateway::start().await;
    let ok = serde_json::json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 3}).to_string();
    let response = gw
        .complete(&ok)
        .header("x-acs-workload", "batch")
        .send()
        .await
        .unwrap();
    let completion: serde_json::Value = response.json().await.unwrap();
    let stream =
        serde_json::json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": true})
            .to_string();
    let streamed = gw
        .complete(&stream)
        .header("x-acs-workload", "nonsense")
        .send()
        .await
        .unwrap();
    streamed.text().await.unwrap();
    let bad = serde_json::json!({"model": MODEL, "prompt": PROMPT, "temperature": 500}).to_string();
    assert_eq!(gw.complete(&bad).send().await.unwrap().status(), 400);
    let anonymous = gw
        .client
        .get(format!("{}/v1/models", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    // Health probes are not API requests: no row.
    let health = gw
        .client
        .get(format!("{}/health", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);

    // Streams are logged when they end; wait for their settlement, then for the writer.
    gw.state.tasks().close();
    gw.state.tasks().wait().await;
    gw.state.request_log().flush().await;
    let rows = gw.state.store().recent_requests(10).await.unwrap();
    assert_eq!(rows.len(), 4, "{rows:?}");
    let prefix = &gw.key[..12];

    let json_row = rows
        .iter()
        .find(|r| r.workload.as_deref() == Some("batch"))
        .unwrap();
    assert_eq!(json_row.status, 200);
    assert_eq!(json_row.endpoint, "/v1/completions");
    assert_eq!(json_row.model.as_deref(), Some(MODEL));
    assert_eq!(json_row.key_prefix.as_deref(), Some(prefix));
    assert_eq!(json_row.completion_tokens, Some(3));
    assert_eq!(
        json_row.prompt_tokens,
        completion["usage"]["prompt_tokens"].as_u64()
    );
    assert!(json_row.client_ip.is_some_and(|ip| ip.is_loopback()));

    let stream_row = rows
        .iter()
        .find(|r| r.status == 200 && r.workload.is_none())
        .unwrap();
    assert_eq!(
        stream_row.completion_tokens,
        Some(2),
        "streams are logged with their final usage"
    );

    let rejected = rows.iter().find(|r| r.status == 400).unwrap();
    assert_eq!(rejected.error_code.as_deref(), Some("invalid_request"));
    assert_eq!(rejected.key_prefix.as_deref(), Some(prefix));
    let unauthorized = rows.iter().find(|r| r.status == 401).unwrap();
    assert_eq!(unauthorized.error_code.as_deref(), Some("invalid_api_key"));
    assert_eq!(unauthorized.endpoint, "/v1/models");
    assert!(unauthorized.key_id.is_none());

    for row in &rows {
        let text = format!("{row:?}");
        assert!(!text.contains(PROMPT), "prompt text in the log: {text}");
        assert!(!text.contains(&gw.key), "a key secret in the log: {text}");
        let generated = completion["choices"][0]["text"].as_str().unwrap();
        assert!(
            !text.contains(generated),
            "completion text in the log: {text}"
        );
    }
}

/// A request that waited for its turn in its key's queue says how long, in its
/// request-log row and in `fleetgate_queue_wait_seconds`; one that was never admitted
/// has no wait.
#[tokio::test]
async fn a_requests_wait_for_its_turn_is_in_its_row_and_the_metrics() {
    let gw = Gateway::start().await;
    let (id, key) = gw.key_with_slots(1, Some(4)).await;
    let body = serde_json::json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 1}).to_string();
    // The first runs, held at the node; the second waits in the key's queue behind it.
    gw.mock.close_gate();
    let first = tokio::spawn(
        gw.complete_as(&key, &body)
            .header("x-request-id", "first")
            .send(),
    );
    gw.wait_occupancy(id, 1, 0).await;
    let second = tokio::spawn(
        gw.complete_as(&key, &body)
            .header("x-request-id", "second")
            .send(),
    );
    gw.wait_occupancy(id, 1, 1).await;
    // How long the second waits: the test's choice, which its row must then show.
    let held = std::time::Duration::from_millis(300);
    tokio::time::sleep(held).await;
    gw.mock.open_gate();
    for request in [first, second] {
        let response = request.await.unwrap().unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    let refused =
        serde_json::json!({"model": MODEL, "prompt": [1], "temperature": 500}).to_string();
    assert_eq!(
        gw.complete_as(&key, &refused)
            .send()
            .await
            .unwrap()
            .status(),
        400
    );

    gw.state.request_log().flush().await;
    let rows = gw.state.store().recent_requests(10).await.unwrap();
    // The one that waited behind the other, and the one admitted at once.
    let mut waits: Vec<u64> = rows
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.queue_wait_ms.expect("an admitted request's wait"))
        .collect();
    waits.sort_unstable();
    let [at_once, waited] = waits[..] else {
        panic!("two served rows: {rows:?}")
    };
    assert!(
        (250..5_000).contains(&waited),
        "waited {waited} ms behind a request held {} ms",
        held.as_millis()
    );
    assert!(
        at_once < 250,
        "the first was admitted at once: {at_once} ms"
    );
    let never = rows.iter().find(|r| r.status == 400).unwrap();
    assert_eq!(never.queue_wait_ms, None, "never admitted, never waited");

    let text = gw.metrics_text().await;
    let count = crate::common::parse_metrics(&text)
        .into_iter()
        .find(|s| {
            s.name == "fleetgate_queue_wait_seconds_count"
                && s.labels.get("model").is_some_and(|m| m == MODEL)
        })
        .map_or(0.0, |s| s.value);
    assert_eq!(count, 2.0, "both admitted requests observed");
}
