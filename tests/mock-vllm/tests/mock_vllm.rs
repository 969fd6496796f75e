//! mock-vllm over real HTTP: wire shapes, validation, failure modes and test controls.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::future::Future;
use std::time::Duration;

use mock_vllm::{FailureMode, MockConfig, MockVllm};
use serde_json::{Value, json};

/// Upper bound on every wait in these tests.
const LIMIT: Duration = Duration::from_secs(10);

async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(LIMIT, future)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

async fn start(config: MockConfig) -> MockVllm {
    MockVllm::start(config).await.unwrap()
}

async fn post(mock: &MockVllm, path: &str, body: &Value) -> reqwest::Response {
    let request = reqwest::Client::new()
        .post(format!("{}{path}", mock.url()))
        .json(body)
        .send();
    within("request", request).await.unwrap()
}

/// POST /v1/completions; returns the status and the raw body.
async fn complete(mock: &MockVllm, body: Value) -> (u16, String) {
    let response = post(mock, "/v1/completions", &body).await;
    let status = response.status().as_u16();
    (status, within("body", response.text()).await.unwrap())
}

async fn complete_json(mock: &MockVllm, body: Value) -> Value {
    let (status, text) = complete(mock, body).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// Split an SSE body into its `data:` payloads, checking the framing.
fn frames(body: &str) -> Vec<&str> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    body.split_terminator("\n\n")
        .map(|frame| {
            frame
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad frame {frame:?}"))
        })
        .collect()
}

fn keys(value: &Value) -> Vec<&str> {
    value
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect()
}

fn error_message(text: &str) -> String {
    let value: Value = serde_json::from_str(text).unwrap();
    assert_eq!(keys(&value["error"]), ["message", "type", "param", "code"]);
    value["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn non_stream_body_has_vllm_key_order_and_nulls() {
    let mock = start(MockConfig::default()).await;
    let (status, text) = complete(&mock, json!({"prompt": "Hello world", "max_tokens": 3})).await;
    assert_eq!(status, 200);
    assert!(text.starts_with(r#"{"id":"cmpl-"#), "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        keys(&body),
        [
            "id",
            "object",
            "created",
            "model",
            "choices",
            "service_tier",
            "system_fingerprint",
            "usage",
            "kv_transfer_params"
        ]
    );
    let id = body["id"].as_str().unwrap().strip_prefix("cmpl-").unwrap();
    assert!(
        id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit()),
        "{id}"
    );
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], "meta-llama/Llama-3.1-8B");
    let choice = &body["choices"][0];
    assert_eq!(
        keys(choice),
        [
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
            "token_ids",
            "prompt_logprobs",
            "prompt_token_ids"
        ]
    );
    assert_eq!(choice["finish_reason"], "length");
    for null in [
        "logprobs",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
    ] {
        assert!(choice[null].is_null(), "{null}");
    }
    for null in ["service_tier", "system_fingerprint", "kv_transfer_params"] {
        assert!(body[null].is_null(), "{null}");
    }
    assert_eq!(
        keys(&body["usage"]),
        [
            "prompt_tokens",
            "total_tokens",
            "completion_tokens",
            "prompt_tokens_details"
        ]
    );
    assert_eq!(body["usage"]["completion_tokens"], 3);

    // Deterministic, and X-Request-Id feeds the id.
    let again = reqwest::Client::new()
        .post(format!("{}/v1/completions", mock.url()))
        .header("x-request-id", "trace-1")
        .json(&json!({"prompt": "Hello world", "max_tokens": 3}))
        .send();
    let again: Value = within("request", again)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again["id"], "cmpl-trace-1");
    assert_eq!(again["choices"][0]["text"], choice["text"]);
    assert_eq!(mock.received().len(), 2);
    assert_eq!(mock.received()[1].json()["prompt"], "Hello world");
}

#[tokio::test]
async fn stream_is_framed_with_a_usage_chunk_and_done() {
    let mock = start(MockConfig::default()).await;
    let request = json!({"prompt": "Once", "max_tokens": 5, "seed": 7});
    let plain = complete_json(&mock, request.clone()).await;

    let mut stream_request = request;
    stream_request["stream"] = json!(true);
    stream_request["stream_options"] = json!({"include_usage": true});
    let response = post(&mock, "/v1/completions", &stream_request).await;
    assert_eq!(
        response.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let body = within("stream", response.text()).await.unwrap();
    let frames = frames(&body);
    assert_eq!(frames.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    let (usage, content) = chunks.split_last().unwrap();
    assert_eq!(content.len(), 5, "a chunk per token");
    let mut text = String::new();
    for (i, chunk) in content.iter().enumerate() {
        assert_eq!(
            keys(chunk),
            ["id", "object", "created", "model", "choices", "usage"]
        );
        assert!(chunk["usage"].is_null());
        let choice = &chunk["choices"][0];
        assert_eq!(
            keys(choice),
            [
                "index",
                "text",
                "logprobs",
                "finish_reason",
                "stop_reason",
                "prompt_token_ids",
                "token_ids"
            ]
        );
        let last = i == content.len() - 1;
        assert_eq!(
            choice["finish_reason"],
            if last { json!("length") } else { Value::Null }
        );
        text.push_str(choice["text"].as_str().unwrap());
    }
    assert_eq!(
        text,
        plain["choices"][0]["text"].as_str().unwrap(),
        "same output as non-stream"
    );
    assert_eq!(usage["choices"], json!([]));
    let expected = &plain["usage"];
    assert_eq!(usage["usage"]["prompt_tokens"], expected["prompt_tokens"]);
    assert_eq!(usage["usage"]["total_tokens"], expected["total_tokens"]);
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(
        keys(&usage["usage"]),
        ["prompt_tokens", "total_tokens", "completion_tokens"]
    );
}

#[tokio::test]
async fn n2_stream_interleaves_choices_and_batches_are_prompt_major() {
    let mock = start(MockConfig::default()).await;
    let (_, body) = complete(
        &mock,
        json!({"prompt": "Once", "max_tokens": 3, "n": 2, "stream": true}),
    )
    .await;
    let indices: Vec<u64> = frames(&body)
        .iter()
        .filter(|f| **f != "[DONE]")
        .map(|f| {
            serde_json::from_str::<Value>(f).unwrap()["choices"][0]["index"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(indices, [0, 1, 0, 1, 0, 1]);

    let batch = complete_json(
        &mock,
        json!({"prompt": ["a", "b c"], "max_tokens": 2, "n": 2}),
    )
    .await;
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(
        choices
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_ne!(choices[0]["text"], choices[1]["text"], "n samples differ");
    assert_eq!(batch["usage"]["prompt_tokens"], 2 + 3);
    assert_eq!(batch["usage"]["completion_tokens"], 8);
}

#[tokio::test]
async fn stop_string_cuts_the_text() {
    let mock = start(MockConfig::default()).await;
    let request = json!({"prompt": "Once upon a time", "max_tokens": 200, "stop": [" the"]});
    let body = complete_json(&mock, request.clone()).await;
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["stop_reason"], " the");
    assert!(!choice["text"].as_str().unwrap().contains(" the"));

    let mut stream_request = request;
    stream_request["stream"] = json!(true);
    let (_, stream) = complete(&mock, stream_request).await;
    let chunks: Vec<Value> = frames(&stream)
        .iter()
        .filter(|f| **f != "[DONE]")
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, choice["text"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["choices"][0]["stop_reason"], " the");
}

#[tokio::test]
async fn echo_prepends_the_prompt_as_sent_or_decoded() {
    let mock = start(MockConfig::default()).await;
    let body = complete_json(
        &mock,
        json!({"prompt": "Hello world", "max_tokens": 2, "echo": true}),
    )
    .await;
    let text = body["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("Hello world") && text.len() > "Hello world".len(),
        "{text}"
    );

    let tokens: Value = post(&mock, "/tokenize", &json!({"prompt": "Hello world"}))
        .await
        .json()
        .await
        .unwrap();
    let ids = tokens["tokens"].clone();
    let body = complete_json(&mock, json!({"prompt": ids, "max_tokens": 2, "echo": true})).await;
    let text = body["choices"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("<|begin_of_text|>Hello world"), "{text}");
}

#[tokio::test]
async fn logprobs_are_four_parallel_arrays() {
    let mock = start(MockConfig::default()).await;
    let body = complete_json(
        &mock,
        json!({"prompt": "Hello", "max_tokens": 5, "logprobs": 2}),
    )
    .await;
    let choice = &body["choices"][0];
    let logprobs = &choice["logprobs"];
    assert_eq!(
        keys(logprobs),
        ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    );
    let tokens = logprobs["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 5);
    let mut offset = 0;
    for (i, token) in tokens.iter().enumerate() {
        let token = token.as_str().unwrap();
        assert_eq!(logprobs["text_offset"][i], offset);
        offset += token.chars().count();
        let top = logprobs["top_logprobs"][i].as_object().unwrap();
        assert!(top.len() == 2 || top.len() == 3, "{top:?}");
        assert_eq!(top.keys().next().unwrap(), token, "sampled token first");
        assert_eq!(top[token], logprobs["token_logprobs"][i]);
    }
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, choice["text"].as_str().unwrap());

    // echo + logprobs also covers the prompt and implies prompt_logprobs.
    let body = complete_json(
        &mock,
        json!({"prompt": "Hello", "max_tokens": 1, "logprobs": 1, "echo": true}),
    )
    .await;
    let choice = &body["choices"][0];
    assert_eq!(choice["logprobs"]["tokens"][0], "<|begin_of_text|>");
    assert!(choice["logprobs"]["token_logprobs"][0].is_null());
    assert!(choice["prompt_logprobs"][0].is_null());
}

#[tokio::test]
async fn full_vocab_prompt_logprobs_list_every_token() {
    let mock = start(MockConfig {
        vocab_size: 50,
        ..MockConfig::default()
    })
    .await;
    let response = post(
        &mock,
        "/v1/completions",
        &json!({"prompt": [5, 9, 17, 42], "max_tokens": 1, "prompt_logprobs": -1}),
    )
    .await;
    assert!(
        response.headers().get("content-length").is_none(),
        "streamed body"
    );
    let body: Value = within("body", response.json()).await.unwrap();
    let list = body["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(list.len(), 4);
    assert!(list[0].is_null());
    for (entry, prompt_id) in list[1..].iter().zip(["9", "17", "42"]) {
        let entry = entry.as_object().unwrap();
        assert_eq!(entry.len(), 50);
        assert_eq!(
            entry.keys().next().unwrap(),
            prompt_id,
            "the prompt token comes first"
        );
        let first = &entry[prompt_id];
        assert_eq!(keys(first), ["logprob", "rank", "decoded_token"]);
        let mut ranks: Vec<u64> = entry
            .values()
            .map(|v| v["rank"].as_u64().unwrap())
            .collect();
        ranks.sort_unstable();
        assert_eq!(ranks, (1..=50).collect::<Vec<_>>());
    }
}

#[tokio::test]
async fn tokenize_count_matches_prompt_tokens() {
    let mock = start(MockConfig::default()).await;
    for prompt in ["Hello world", "héllo — 日本語", ""] {
        let tokens: Value = post(&mock, "/tokenize", &json!({"prompt": prompt}))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(
            keys(&tokens),
            ["count", "max_model_len", "tokens", "token_strs"]
        );
        assert_eq!(tokens["tokens"][0], 128_000, "BOS");
        let body = complete_json(&mock, json!({"prompt": [prompt], "max_tokens": 1})).await;
        assert_eq!(
            body["usage"]["prompt_tokens"], tokens["count"],
            "{prompt:?}"
        );
    }
    let no_bos: Value = post(
        &mock,
        "/tokenize",
        &json!({"prompt": "Hi", "add_special_tokens": false}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(no_bos["count"], 1);
    assert_eq!(
        mock.received()
            .iter()
            .filter(|r| r.path == "/tokenize")
            .count(),
        4
    );
}

#[tokio::test]
async fn empty_prompts_follow_vllm_0_10_2() {
    let mock = start(MockConfig::default()).await;
    let (status, text) = complete(&mock, json!({"prompt": ""})).await;
    assert_eq!(status, 400);
    assert!(
        error_message(&text)
            .contains("Either prompt or prompt_embeds must be provided and non-empty.")
    );

    let body = complete_json(
        &mock,
        json!({"prompt": [""], "max_tokens": 1, "return_token_ids": true}),
    )
    .await;
    assert_eq!(
        body["choices"][0]["prompt_token_ids"],
        json!([128_000]),
        "just BOS"
    );
    assert_eq!(body["usage"]["prompt_tokens"], 1);

    for empty in [json!([]), json!([[]])] {
        let (status, text) = complete(&mock, json!({"prompt": empty})).await;
        assert_eq!(status, 400);
        assert_eq!(error_message(&text), "please provide at least one prompt");
    }
}

#[tokio::test]
async fn validation_errors_use_the_envelope() {
    let mock = start(MockConfig {
        max_model_len: 20,
        ..MockConfig::default()
    })
    .await;
    let prompt: Vec<u32> = (10..20).collect();
    let (status, text) = complete(&mock, json!({"prompt": prompt, "max_tokens": 11})).await;
    assert_eq!(status, 400);
    assert_eq!(
        error_message(&text),
        "This model's maximum context length is 9 tokens. However, your request has 10 input tokens. Please reduce the length of the input messages."
    );
    let (status, _) = complete(&mock, json!({"prompt": prompt, "max_tokens": 10})).await;
    assert_eq!(status, 200, "P + K = M is allowed");

    let cases = [
        (
            json!({"prompt": "a", "logprobs": 21}),
            400,
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        (
            json!({"prompt": "a", "prompt_logprobs": 1, "stream": true}),
            400,
            "`prompt_logprobs` are not available when `stream=True`.",
        ),
        (
            json!({"prompt": "a", "stream_options": {"include_usage": true}}),
            400,
            "Stream options can only be defined when `stream=True`.",
        ),
        (
            json!({"prompt": [1, 128_256]}),
            400,
            "Token id 128256 is out of vocabulary",
        ),
        (
            json!({"prompt": "a", "n": 0}),
            400,
            "n must be at least 1, got 0.",
        ),
        (
            json!({"prompt": "a", "temperature": -1}),
            400,
            "temperature must be non-negative, got -1.0.",
        ),
        (
            json!({"prompt": "a", "top_p": 0}),
            400,
            "top_p must be in (0, 1], got 0.0.",
        ),
        (
            json!({"prompt": "a", "model": "other"}),
            404,
            "The model `other` does not exist.",
        ),
    ];
    let mock = start(MockConfig::default()).await;
    for (request, expected_status, message) in cases {
        let (status, text) = complete(&mock, request.clone()).await;
        assert_eq!(status, expected_status, "{request}: {text}");
        assert!(error_message(&text).contains(message), "{request}: {text}");
    }
    // Unknown fields are ignored; lax types are coerced.
    let body = complete_json(
        &mock,
        json!({"prompt": "a", "max_tokens": "2", "n": 2.0, "whatever": 1}),
    )
    .await;
    assert_eq!(body["usage"]["completion_tokens"], 4);
}

#[tokio::test]
async fn ops_endpoints() {
    let mock = start(MockConfig {
        served_model_name: "m".into(),
        max_model_len: 1234,
        ..MockConfig::default()
    })
    .await;
    let client = reqwest::Client::new();
    let models: Value = client
        .get(format!("{}/v1/models", mock.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let card = &models["data"][0];
    assert_eq!(
        keys(card),
        [
            "id",
            "object",
            "created",
            "owned_by",
            "root",
            "parent",
            "max_model_len",
            "permission"
        ]
    );
    assert_eq!(
        (card["id"].as_str(), card["max_model_len"].as_u64()),
        (Some("m"), Some(1234))
    );

    let health = client
        .get(format!("{}/health", mock.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert!(health.text().await.unwrap().is_empty());

    let metrics = metrics_text(&client, &mock.url()).await;
    assert!(
        metrics.contains("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0"),
        "{metrics}"
    );
    assert!(metrics.contains("vllm:num_requests_waiting{"));
    assert!(metrics.contains("vllm:kv_cache_usage_perc{"));

    let missing = client
        .get(format!("{}/v2/nope", mock.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.text().await.unwrap(), r#"{"detail":"Not Found"}"#);
}

#[tokio::test]
async fn stream_error_mode_sends_a_mid_stream_error_event() {
    let mock = start(MockConfig::default()).await;
    mock.set_failure(FailureMode::StreamError { after_chunks: 2 });
    let request = json!({"prompt": "a", "max_tokens": 10, "stream": true});
    let (status, body) = complete(&mock, request).await;
    assert_eq!(status, 200);
    let frames = frames(&body);
    assert_eq!(frames.len(), 4);
    assert_eq!(
        frames[2],
        r#"{"error": {"message": "mock failure", "type": "BadRequestError", "param": null, "code": 400}}"#
    );
    assert_eq!(frames[3], "[DONE]");
}

#[tokio::test]
async fn status500_mode() {
    let mock = start(MockConfig::default()).await;
    mock.set_failure(FailureMode::Status500);
    let (status, text) = complete(&mock, json!({"prompt": "a"})).await;
    assert_eq!(status, 500);
    assert_eq!(
        text,
        r#"{"error":{"message":"","type":"Internal Server Error","param":null,"code":500}}"#
    );
    let health = within("health", reqwest::get(format!("{}/health", mock.url())))
        .await
        .unwrap();
    assert_eq!(health.status(), 503);
    mock.set_failure(FailureMode::None);
    assert_eq!(complete(&mock, json!({"prompt": "a"})).await.0, 200);
}

#[tokio::test]
async fn refuse_mode_closes_the_port_and_reopens_it() {
    let mock = start(MockConfig::default()).await;
    let pooled = reqwest::Client::new();
    let health = format!("{}/health", mock.url());
    assert_eq!(pooled.get(&health).send().await.unwrap().status(), 200);

    mock.set_failure(FailureMode::Refuse);
    // The kept-alive connection is dropped too (the request on it fails one way or another),
    let error = within("pooled", pooled.get(&health).send())
        .await
        .unwrap_err();
    assert!(error.is_request() || error.is_connect(), "{error:?}");
    // and new connections are refused.
    let error = within("refused", reqwest::Client::new().get(&health).send())
        .await
        .unwrap_err();
    assert!(error.is_connect(), "{error:?}");
    assert!(
        within("refused", tokio::net::TcpStream::connect(mock.addr()))
            .await
            .is_err()
    );

    mock.set_failure(FailureMode::None);
    let response = within("reopened", reqwest::Client::new().get(&health).send())
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.url().port(), Some(mock.addr().port()));
}

#[tokio::test]
async fn hang_mode_never_answers_and_counts_the_cancellation() {
    let mock = start(MockConfig::default()).await;
    mock.set_failure(FailureMode::Hang);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let error = client
        .post(format!("{}/v1/completions", mock.url()))
        .json(&json!({"prompt": "a"}))
        .send()
        .await
        .unwrap_err();
    assert!(error.is_timeout(), "{error:?}");
    within("cancellation", mock.wait_cancelled(1)).await;
    assert_eq!(mock.in_flight(), 0);
}

#[tokio::test]
async fn cut_stream_mode_drops_the_connection_before_done() {
    let mock = start(MockConfig::default()).await;
    mock.set_failure(FailureMode::CutStream { after_chunks: 2 });
    let mut response = post(
        &mock,
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 10, "stream": true}),
    )
    .await;
    let mut received = Vec::new();
    let ended_with_error = loop {
        match within("chunk", response.chunk()).await {
            Ok(Some(chunk)) => received.extend_from_slice(&chunk),
            Ok(None) => break false,
            Err(_) => break true,
        }
    };
    assert!(ended_with_error, "the body must end abnormally");
    let text = String::from_utf8(received).unwrap();
    assert_eq!(frames(&text).len(), 2, "{text}");
    assert!(!text.contains("[DONE]"));

    let response = post(
        &mock,
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 10}),
    )
    .await;
    assert!(
        within("body", response.text()).await.is_err(),
        "non-stream body is cut too"
    );
    assert_eq!(mock.cancelled(), 0, "a cut is not a client cancellation");
}

#[tokio::test]
async fn dropping_a_stream_midway_counts_as_cancelled() {
    let mock = start(MockConfig {
        token_delay: Duration::from_millis(20),
        ..MockConfig::default()
    })
    .await;
    let mut response = post(
        &mock,
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 1000, "stream": true}),
    )
    .await;
    let first = within("first chunk", response.chunk())
        .await
        .unwrap()
        .unwrap();
    assert!(first.starts_with(b"data: {"));
    assert_eq!(mock.in_flight(), 1);
    drop(response);
    within("cancellation", mock.wait_cancelled(1)).await;
    assert_eq!(mock.cancelled(), 1);
    assert_eq!(mock.in_flight(), 0);
}

#[tokio::test]
async fn closed_gate_holds_requests_until_opened() {
    let mock = start(MockConfig::default()).await;
    mock.close_gate();
    let requests: Vec<_> = (0..2)
        .map(|_| {
            let mock = mock.clone();
            tokio::spawn(
                async move { complete(&mock, json!({"prompt": "a", "max_tokens": 2})).await },
            )
        })
        .collect();
    within("both in flight", mock.wait_in_flight(2)).await;
    assert_eq!(mock.received().len(), 2);
    assert!(
        requests.iter().all(|r| !r.is_finished()),
        "held at the gate"
    );
    mock.open_gate();
    for request in requests {
        assert_eq!(within("answer", request).await.unwrap().0, 200);
    }
    assert_eq!(mock.in_flight(), 0);
    mock.shutdown().await;
}

async fn metrics_text(client: &reqwest::Client, base_url: &str) -> String {
    let response = client
        .get(format!("{base_url}/metrics"))
        .send()
        .await
        .unwrap();
    response.text().await.unwrap()
}

/// `vllm:prefix_cache_{queries,hits}_total` of the mock's `/metrics`.
async fn prefix_cache_counters(mock: &MockVllm) -> (f64, f64) {
    let text = metrics_text(&reqwest::Client::new(), &mock.url()).await;
    let counter = |name: &str| {
        text.lines()
            .find(|line| line.starts_with(&format!("{name}{{")))
            .and_then(|line| line.rsplit_once(' '))
            .and_then(|(_, value)| value.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} in {text}"))
    };
    (
        counter("vllm:prefix_cache_queries_total"),
        counter("vllm:prefix_cache_hits_total"),
    )
}

/// 64 token ids, distinct per `seed`.
fn ids(seed: u32) -> Vec<u32> {
    (0..64).map(|i| 400 + seed * 64 + i).collect()
}

#[tokio::test]
async fn the_prefix_cache_counts_hits_of_whole_leading_blocks_and_evicts_the_oldest() {
    // Room for two 64-token prompts (eight 16-token blocks).
    let mock = start(MockConfig {
        prefix_cache_tokens: 128,
        ..MockConfig::default()
    })
    .await;
    let send = |prompt: Vec<u32>| {
        let mock = &mock;
        async move {
            complete_json(mock, json!({"prompt": prompt, "max_tokens": 1})).await;
            prefix_cache_counters(mock).await
        }
    };
    assert_eq!(send(ids(0)).await, (64.0, 0.0), "a cold cache misses");
    // Same 64 tokens: the first three blocks hit (the last token is always computed).
    assert_eq!(send(ids(0)).await, (128.0, 48.0));
    // Shares the first two blocks, then differs.
    let mut branch = ids(0);
    branch[40] = 7;
    assert_eq!(send(branch).await, (192.0, 80.0));
    // Two other prompts push the first one out.
    send(ids(1)).await;
    send(ids(2)).await;
    assert_eq!(send(ids(0)).await, (384.0, 80.0), "evicted");
    mock.shutdown().await;
}

#[tokio::test]
async fn uncached_prompt_tokens_delay_the_first_token() {
    let mock = start(MockConfig {
        prefix_cache_tokens: 1024,
        prefill_per_token: Duration::from_millis(5),
        ..MockConfig::default()
    })
    .await;
    let started = std::time::Instant::now();
    complete_json(&mock, json!({"prompt": ids(0), "max_tokens": 1})).await;
    assert!(
        started.elapsed() >= Duration::from_millis(5 * 64),
        "64 tokens to prefill took {:?}",
        started.elapsed()
    );
    mock.shutdown().await;
}

/// A gauge of the mock's `/metrics` (engine 0).
async fn gauge(mock: &MockVllm, name: &str) -> f64 {
    let text = metrics_text(&reqwest::Client::new(), &mock.url()).await;
    text.lines()
        .find(|line| line.starts_with(&format!("{name}{{")))
        .and_then(|line| line.rsplit_once(' '))
        .and_then(|(_, value)| value.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{name} in {text}"))
}

/// `vllm:num_requests_running`, `vllm:num_requests_waiting` and
/// `vllm:kv_cache_usage_perc`, as `/metrics` reports them.
async fn batch_gauges(mock: &MockVllm) -> (f64, f64, f64) {
    (
        gauge(mock, "vllm:num_requests_running").await,
        gauge(mock, "vllm:num_requests_waiting").await,
        gauge(mock, "vllm:kv_cache_usage_perc").await,
    )
}

/// Polls `/metrics` until `running + waiting` is `n` (the requests sent so far have
/// reached the engine).
async fn wait_scheduled(mock: &MockVllm, n: f64) {
    within("scheduled", async {
        loop {
            let (running, waiting, _) = batch_gauges(mock).await;
            if running + waiting == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn max_num_seqs_runs_a_batch_and_queues_the_rest_in_arrival_order() {
    // Each request decodes 100 tokens, 20 ms apart: ~2 s, long enough to send the
    // next ones while the first run, even on a busy machine.
    let mock = start(MockConfig {
        max_num_seqs: Some(2),
        token_delay: Duration::from_millis(20),
        ..MockConfig::default()
    })
    .await;
    assert_eq!(batch_gauges(&mock).await, (0.0, 0.0, 0.0));
    // Sent one after the other, each once the one before is in the engine.
    let mut requests = Vec::new();
    for i in 0..4 {
        let mock_ = mock.clone();
        requests.push(tokio::spawn(async move {
            complete_json(&mock_, json!({"prompt": "a", "max_tokens": 100})).await;
            std::time::Instant::now()
        }));
        wait_scheduled(&mock, f64::from(i + 1)).await;
    }
    assert_eq!(
        batch_gauges(&mock).await,
        (2.0, 2.0, 1.0),
        "two decode, two wait; the batch is full"
    );
    assert_eq!((mock.running(), mock.waiting()), (2, 2));
    let mut done = Vec::new();
    for request in requests {
        done.push(within("answer", request).await.unwrap());
    }
    // The two that waited started when the first two ended.
    assert!(
        done[2].min(done[3]) > done[0].max(done[1]),
        "the waiting ones finished after the running ones"
    );
    assert_eq!(batch_gauges(&mock).await, (0.0, 0.0, 0.0));
    mock.shutdown().await;
}

#[tokio::test]
async fn a_request_waiting_for_the_batch_that_is_dropped_leaves_the_queue() {
    let mock = start(MockConfig {
        max_num_seqs: Some(1),
        token_delay: Duration::from_millis(20),
        ..MockConfig::default()
    })
    .await;
    // ~4 s: it is dropped long before.
    let stream = json!({"prompt": "a", "max_tokens": 200, "stream": true});
    let running = post(&mock, "/v1/completions", &stream).await;
    wait_scheduled(&mock, 1.0).await;
    let waiting = tokio::spawn({
        let mock = mock.clone();
        async move { complete(&mock, json!({"prompt": "a", "max_tokens": 1})).await }
    });
    wait_scheduled(&mock, 2.0).await;
    assert_eq!(batch_gauges(&mock).await, (1.0, 1.0, 1.0));
    waiting.abort();
    within("cancellation", mock.wait_cancelled(1)).await;
    assert_eq!((mock.running(), mock.waiting()), (1, 0));
    drop(running);
    within("second cancellation", mock.wait_cancelled(2)).await;
    assert_eq!(batch_gauges(&mock).await, (0.0, 0.0, 0.0));
    mock.shutdown().await;
}

#[tokio::test]
async fn without_max_num_seqs_every_request_runs() {
    let mock = start(MockConfig::default()).await;
    mock.close_gate();
    let requests: Vec<_> = (0..3)
        .map(|_| {
            let mock = mock.clone();
            tokio::spawn(
                async move { complete(&mock, json!({"prompt": "a", "max_tokens": 2})).await },
            )
        })
        .collect();
    within("all in flight", mock.wait_in_flight(3)).await;
    assert_eq!(batch_gauges(&mock).await, (3.0, 0.0, 0.03));
    mock.open_gate();
    for request in requests {
        assert_eq!(within("answer", request).await.unwrap().0, 200);
    }
    mock.shutdown().await;
}
