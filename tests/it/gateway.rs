//! fleetgate in front of mock-vllm over real sockets: what the client gets and what the
//! upstream receives.

use std::time::Duration;

use crate::common::{CHECKPOINT, Gateway, MODEL, expect_error};
use mock_vllm::{FailureMode, MockConfig};
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn json_completion_is_relayed_and_only_the_model_is_rewritten() {
    let gw = Gateway::start().await;
    let body = r#"{"model":"llama-8b","prompt":"The capital of France is","max_tokens":8,"temperature":0.30000000000000004,"seed":9223372036854775807,"top_k":20,"min_p":5e-2}"#;
    let response = gw.complete(body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    assert_eq!(headers["x-acs-upstream-model"], CHECKPOINT);
    assert_eq!(headers["x-acs-upstream-gpu"], "gpu-a");
    assert!(
        headers["x-request-id"]
            .to_str()
            .unwrap()
            .starts_with("req_")
    );
    let text = response.text().await.unwrap();
    assert_eq!(
        headers["content-length"].to_str().unwrap(),
        text.len().to_string(),
        "a JSON answer comes whole, with its length"
    );
    // vLLM's compact body with every null kept: relayed, not re-serialised.
    assert!(text.starts_with(r#"{"id":"cmpl-"#), "{text}");
    assert!(text.contains(r#""service_tier":null"#), "{text}");
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["model"], CHECKPOINT);
    assert_eq!(json["choices"].as_array().unwrap().len(), 1);

    let received = gw.mock.received();
    let sent = received
        .iter()
        .find(|r| r.path == "/v1/completions")
        .unwrap();
    let expected = body.replace(
        r#""model":"llama-8b""#,
        &format!(r#""model":"{CHECKPOINT}""#),
    );
    assert_eq!(
        std::str::from_utf8(&sent.body).unwrap(),
        expected,
        "byte-exact apart from model"
    );
    assert!(
        sent.headers.get("x-request-id").is_none(),
        "our trace id stays ours"
    );
}

#[tokio::test]
async fn without_traces_no_trace_context_goes_upstream() {
    // Traces are off by default; a client's trace context is not passed through either.
    let gw = Gateway::start().await;
    let response = gw
        .complete(r#"{"prompt":"Hi","max_tokens":2}"#)
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .header("tracestate", "vendor=value")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let received = gw.mock.received();
    let sent = received
        .iter()
        .find(|r| r.path == "/v1/completions")
        .unwrap();
    assert!(sent.headers.get("traceparent").is_none());
    assert!(sent.headers.get("tracestate").is_none());
}

#[tokio::test]
async fn a_request_without_model_goes_to_the_default_model() {
    let gw = Gateway::start().await;
    let response = gw
        .complete(r#"{"prompt":"Hi","max_tokens":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(gw.upstream_completions()[0]["model"], CHECKPOINT);
}

#[tokio::test]
async fn omitted_max_tokens_is_injected_from_the_remaining_context() {
    let gw = Gateway::start_with(
        MockConfig {
            max_model_len: 4096,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hello world, how are you"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let tokenized = gw
        .mock
        .received()
        .into_iter()
        .find(|r| r.path == "/tokenize")
        .expect("counted with /tokenize");
    let tokenize_answer: serde_json::Value = gw
        .client
        .post(format!("{}/tokenize", gw.mock.url()))
        .body(tokenized.body.clone())
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let prompt_tokens = tokenize_answer["count"].as_u64().unwrap();
    assert_eq!(
        gw.upstream_completions()[0]["max_tokens"],
        4096 - prompt_tokens
    );
}

#[tokio::test]
async fn omitted_max_tokens_with_a_large_context_is_32000_without_tokenizing() {
    let gw = Gateway::start_with(
        MockConfig {
            max_model_len: 131_072,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hello","max_tokens":null,"stream":true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let _ = response.text().await.unwrap();
    assert_eq!(gw.upstream_completions()[0]["max_tokens"], 32000);
    assert!(gw.mock.received().iter().all(|r| r.path != "/tokenize"));
}

#[tokio::test]
async fn a_prompt_that_fills_the_context_is_refused_before_the_upstream() {
    let gw = Gateway::start_with(
        MockConfig {
            max_model_len: 16,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    let prompt: Vec<u32> = (1..=16).collect();
    let body = serde_json::json!({"model": MODEL, "prompt": prompt}).to_string();
    let response = gw.complete(&body).send().await.unwrap();
    let error = expect_error(response, 400, "invalid_request").await;
    assert_eq!(error["error"]["param"], "prompt");
    assert!(gw.upstream_completions().is_empty());
}

#[tokio::test]
async fn stream_frames_arrive_while_the_upstream_is_still_generating() {
    let gw = Gateway::start_slow(100).await;
    let mut response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Once","max_tokens":50,"stream":true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let first = timeout(WAIT, response.chunk())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.starts_with(b"data: {"), "{first:?}");
    assert_eq!(
        gw.mock.in_flight(),
        1,
        "the first frame was relayed before the upstream finished"
    );
}

#[tokio::test]
async fn stream_with_include_usage_ends_with_the_usage_frame_and_done() {
    let gw = Gateway::start().await;
    let text = gw
        .complete(r#"{"model":"llama-8b","prompt":"Once","max_tokens":4,"n":2,"stream":true,"stream_options":{"include_usage":true}}"#)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let frames: Vec<&str> = text.split("\n\n").filter(|f| !f.is_empty()).collect();
    assert_eq!(frames.last(), Some(&"data: [DONE]"));
    let usage: serde_json::Value =
        serde_json::from_str(frames[frames.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["choices"], serde_json::json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    let indices: std::collections::BTreeSet<u64> = frames[..frames.len() - 2]
        .iter()
        .map(|f| {
            serde_json::from_str::<serde_json::Value>(f.strip_prefix("data: ").unwrap())
                    .unwrap()["choices"][0]["index"]
                    .as_u64()
                    .unwrap()
        })
        .collect();
    assert_eq!(indices, [0, 1].into());
}

#[tokio::test]
async fn a_mid_stream_error_event_passes_through_unchanged() {
    let gw = Gateway::start().await;
    gw.mock
        .set_failure(FailureMode::StreamError { after_chunks: 2 });
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Once","max_tokens":10,"stream":true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let frames: Vec<&str> = text.split("\n\n").filter(|f| !f.is_empty()).collect();
    assert_eq!(frames.len(), 4, "{text}");
    assert_eq!(
        frames[2],
        r#"data: {"error": {"message": "mock failure", "type": "BadRequestError", "param": null, "code": 400}}"#
    );
    assert_eq!(frames[3], "data: [DONE]");
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_the_upstream_request() {
    let gw = Gateway::start_slow(100).await;
    let mut response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Once","max_tokens":200,"stream":true}"#)
        .send()
        .await
        .unwrap();
    timeout(WAIT, response.chunk())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    drop(response);
    timeout(WAIT, gw.mock.wait_cancelled(1))
        .await
        .expect("upstream saw the disconnect");
}

#[tokio::test]
async fn an_upstream_400_is_wrapped_with_its_message_and_error_kind() {
    let gw = Gateway::start_with(
        MockConfig {
            max_model_len: 64,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hello there","max_tokens":1000}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.headers()["x-acs-upstream-error-kind"],
        "upstream_bad_request"
    );
    assert_eq!(response.headers()["x-acs-upstream-gpu"], "gpu-a");
    let error = expect_error(response, 400, "upstream_bad_request").await;
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length"),
        "{error}"
    );
}

#[tokio::test]
async fn an_upstream_500_becomes_a_retryable_502() {
    let gw = Gateway::start().await;
    gw.mock.set_failure(FailureMode::Status500);
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(
        response.headers()["x-acs-upstream-error-kind"],
        "upstream_error"
    );
    expect_error(response, 502, "upstream_error").await;
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_retryable_503() {
    let gw = Gateway::start().await;
    gw.mock.set_failure(FailureMode::Refuse);
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(
        response.headers()["x-acs-upstream-error-kind"],
        "upstream_unavailable"
    );
    expect_error(response, 503, "upstream_unavailable").await;
    gw.mock.set_failure(FailureMode::None);
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "recovers when the upstream is back");
}

#[tokio::test]
async fn full_vocab_prompt_logprobs_is_limited_to_1024_prompt_tokens() {
    let gw = Gateway::start_with(
        MockConfig {
            vocab_size: 64,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    let long: Vec<u32> = (0..1025).map(|i| i % 60).collect();
    let body =
        serde_json::json!({"model": MODEL, "prompt": long, "max_tokens": 1, "prompt_logprobs": -1});
    let response = gw.complete(&body.to_string()).send().await.unwrap();
    expect_error(response, 400, "full_vocab_prompt_too_long").await;
    assert!(gw.upstream_completions().is_empty());

    let ok: Vec<u32> = (0..1024).map(|i| i % 60).collect();
    let body =
        serde_json::json!({"model": MODEL, "prompt": ok, "max_tokens": 1, "prompt_logprobs": -1});
    let response = gw.complete(&body.to_string()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(
        json["choices"][0]["prompt_logprobs"][1]
            .as_object()
            .unwrap()
            .len(),
        64
    );
}

#[tokio::test]
async fn a_long_text_prompt_is_tokenized_to_decide_the_full_vocab_rule() {
    let gw = Gateway::start_with(
        MockConfig {
            vocab_size: 64,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    // More than 1024 bytes, so the byte bound cannot decide; the tokenizer must.
    let prompt = "ab ".repeat(400);
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": -1});
    let response = gw.complete(&body.to_string()).send().await.unwrap();
    let tokenized = gw
        .mock
        .received()
        .into_iter()
        .any(|r| r.path == "/tokenize");
    assert!(tokenized);
    let status = response.status().as_u16();
    let count: u64 = gw
        .client
        .post(format!("{}/tokenize", gw.mock.url()))
        .json(&serde_json::json!({"prompt": prompt}))
        .send()
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap()["count"]
        .as_u64()
        .unwrap();
    assert_eq!(
        status == 200,
        count <= 1024,
        "status {status} for {count} tokens"
    );
}

#[tokio::test]
async fn gzip_is_applied_to_json_when_accepted_but_never_to_streams_or_short_answers() {
    let gw = Gateway::start().await;
    let short = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2}"#)
        .header("accept-encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert!(short.headers().get("content-encoding").is_none());
    assert!(short.bytes().await.unwrap().len() < 1024);

    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hi","max_tokens":16,"logprobs":5}"#)
        .header("accept-encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["content-encoding"], "gzip");
    let compressed = response.bytes().await.unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut flate2::read::GzDecoder::new(&compressed[..]),
        &mut text,
    )
    .unwrap();
    assert!(serde_json::from_str::<serde_json::Value>(&text).unwrap()["choices"].is_array());

    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2,"stream":true}"#)
        .header("accept-encoding", "gzip")
        .send()
        .await
        .unwrap();
    assert!(response.headers().get("content-encoding").is_none());
}

#[tokio::test]
async fn models_lists_short_ids_with_capabilities() {
    let gw = Gateway::start_with(
        MockConfig {
            max_model_len: 8192,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    let json: serde_json::Value = gw
        .get("/v1/models")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let card = &json["data"][0];
    assert_eq!(card["id"], MODEL);
    assert_eq!(card["default"], true);
    assert_eq!(card["checkpoint"], CHECKPOINT);
    assert_eq!(card["max_model_len"], 8192);
    assert_eq!(card["capabilities"]["max_logprobs"], 20);
    assert_eq!(card["capabilities"]["full_vocab_max_prompt_tokens"], 1024);
}

#[tokio::test]
async fn unknown_model_and_chat_are_400_with_their_codes() {
    let gw = Gateway::start().await;
    let response = gw
        .complete(r#"{"model":"gpt-4","prompt":"Hi","max_tokens":2}"#)
        .send()
        .await
        .unwrap();
    let error = expect_error(response, 400, "model_not_found").await;
    assert_eq!(error["error"]["param"], "model");
    // A megabyte of model name comes back as 40 characters, not as a megabyte.
    let huge = "m".repeat(1 << 20);
    let response = gw
        .complete(&serde_json::json!({"model": huge, "prompt": "Hi", "max_tokens": 2}).to_string())
        .send()
        .await
        .unwrap();
    let error = expect_error(response, 400, "model_not_found").await;
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.len() < 200, "{} bytes", message.len());
    assert!(
        message.contains(&format!("'{}…'", "m".repeat(40))),
        "{message}"
    );
    let response = gw
        .client
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(&gw.key)
        .json(&serde_json::json!({"model": MODEL, "messages": []}))
        .send()
        .await
        .unwrap();
    expect_error(response, 400, "chat_completions_unsupported").await;
    assert!(gw.upstream_completions().is_empty());
}

#[tokio::test]
async fn logprobs_above_the_model_cap_are_rejected_with_the_bound() {
    let gw = Gateway::start().await;
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2,"logprobs":21}"#)
        .send()
        .await
        .unwrap();
    let error = expect_error(response, 400, "invalid_request").await;
    assert_eq!(error["error"]["param"], "logprobs");
    assert!(
        error["error"]["message"].as_str().unwrap().contains("20"),
        "{error}"
    );
    let response = gw
        .complete(r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2,"logprobs":20}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test]
async fn every_framework_error_is_an_envelope() {
    let gw = Gateway::start().await;
    let r = gw.get("/v1/nope").send().await.unwrap();
    expect_error(r, 404, "not_found").await;
    let r = gw
        .client
        .get(format!("{}/nothing/here", gw.url))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, "not_found").await;
    let r = gw.get("/v1/completions").send().await.unwrap();
    expect_error(r, 405, "method_not_allowed").await;
    let r = gw
        .complete(r#"{"model": "llama-8b", "prompt": "#)
        .send()
        .await
        .unwrap();
    expect_error(r, 400, "invalid_request").await;
    let r = gw
        .client
        .post(format!("{}/v1/completions", gw.url))
        .bearer_auth(&gw.key)
        .header("content-type", "text/plain")
        .body(r#"{"prompt":"Hi"}"#)
        .send()
        .await
        .unwrap();
    let error = expect_error(r, 400, "invalid_request").await;
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("application/json")
    );
    let r = gw
        .client
        .post(format!("{}/v1/completions", gw.url))
        .bearer_auth(&gw.key)
        .body(r#"{"prompt":"Hi"}"#)
        .send()
        .await
        .unwrap();
    let error = expect_error(r, 400, "invalid_request").await;
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("got none")
    );
    assert!(gw.upstream_completions().is_empty());
}

#[tokio::test]
async fn keys_are_required_checked_and_revocable_at_once() {
    let gw = Gateway::start().await;
    let body = r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2}"#;
    let anonymous = gw
        .client
        .post(format!("{}/v1/completions", gw.url))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    expect_error(anonymous, 401, "invalid_api_key").await;
    let wrong = gw
        .complete_as("fg-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", body)
        .send()
        .await
        .unwrap();
    expect_error(wrong, 401, "invalid_api_key").await;
    let junk = gw
        .client
        .post(format!("{}/v1/completions", gw.url))
        .header("authorization", "Basic abc")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    expect_error(junk, 401, "invalid_api_key").await;
    let models = gw
        .client
        .get(format!("{}/v1/models", gw.url))
        .send()
        .await
        .unwrap();
    expect_error(models, 401, "invalid_api_key").await;

    assert_eq!(gw.complete(body).send().await.unwrap().status(), 200);
    assert_eq!(gw.upstream_completions().len(), 1);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_and_not_retryable() {
    let gw = Gateway::start_with(MockConfig::default(), "max_body_bytes = 1024").await;
    let prompt = "x".repeat(2000);
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let response = gw.complete(&body).send().await.unwrap();
    assert_eq!(response.headers()["x-should-retry"], "false");
    expect_error(response, 413, "request_too_large").await;

    // Without a Content-Length (chunked), the limit still holds.
    let stream = futures_util::stream::iter(vec![Ok::<_, std::io::Error>(body.into_bytes())]);
    let response = gw
        .complete("")
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    expect_error(response, 413, "request_too_large").await;
}

#[tokio::test]
async fn health_openapi_and_swagger_need_no_key() {
    let gw = Gateway::start().await;
    let health = gw
        .client
        .get(format!("{}/health", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert!(health.headers().contains_key("x-request-id"));
    let spec: serde_json::Value = gw
        .client
        .get(format!("{}/openapi.json", gw.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(spec["paths"]["/v1/completions"]["post"].is_object());
    let swagger = gw
        .client
        .get(format!("{}/swagger/", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(swagger.status(), 200);
    assert!(swagger.text().await.unwrap().contains("swagger"));
}
