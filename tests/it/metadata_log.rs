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
