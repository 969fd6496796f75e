//! The request window of non-streaming requests, end to end: an omitted `max_tokens` is
//! cut to what the model decodes within the window (alone and with the key's budget),
//! an explicit one that cannot fit is refused unless streamed, and an upstream that
//! overruns the window is cut with 504 — aborted upstream, nothing charged.

use std::time::{Duration, Instant};

use crate::common::{self, Gateway, MODEL, expect_error};
use fleetgate::store::LimitOverrides;
use mock_vllm::MockConfig;
use serde_json::json;

/// Bound on every wait in this file: a test fails rather than hangs.
const WAIT: Duration = Duration::from_secs(20);

/// The prompt of every request: three token ids (counted exactly, no `/tokenize`).
const PROMPT: [u32; 3] = [1, 2, 3];
/// The injected default for [`PROMPT`]: the mock's `max_model_len` (8192) − 3.
const DEFAULT_MAX_TOKENS: u64 = 8189;

/// A gateway whose single model decodes `decode_tokens_per_second` within a window of
/// `window_ms`, in front of a fresh mock.
async fn gateway(window_ms: u64, decode_tokens_per_second: f64) -> Gateway {
    let mock = common::node(MockConfig::default()).await;
    Gateway::start_fleet(
        &format!("[fleet]\nrequest_window_ms = {window_ms}"),
        &format!("decode_tokens_per_second = {decode_tokens_per_second:?}"),
        &[(&mock, "gpu-a", "")],
    )
    .await
}

/// A completion request body for [`PROMPT`]; `max_tokens` left out when `None`.
fn body(max_tokens: Option<u64>, stream: bool) -> String {
    let mut body = json!({"model": MODEL, "prompt": PROMPT, "stream": stream});
    if let Some(max_tokens) = max_tokens {
        body["max_tokens"] = max_tokens.into();
    }
    body.to_string()
}

/// Sends `request`, bounded by [`WAIT`].
async fn send(request: reqwest::RequestBuilder) -> reqwest::Response {
    request.timeout(WAIT).send().await.unwrap()
}

/// Sends `request`, bounded by [`WAIT`], and expects a 200.
async fn send_ok(request: reqwest::RequestBuilder) -> reqwest::Response {
    let response = send(request).await;
    assert_eq!(response.status(), 200);
    response
}

fn clamp_header(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get("x-acs-max-tokens-clamped")
        .map(|v| v.to_str().unwrap().to_owned())
}

/// A 20 s window at 3.5 tokens/s: floor(70.0) = 70 tokens fit.
const WINDOW_MS: u64 = 20_000;
const RATE: f64 = 3.5;
const FIT: u64 = 70;

#[tokio::test]
async fn an_omitted_max_tokens_is_cut_to_what_decodes_within_the_window() {
    let gw = gateway(WINDOW_MS, RATE).await;

    let response = send_ok(gw.complete(&body(None, false))).await;
    assert_eq!(
        clamp_header(&response).as_deref(),
        Some(
            format!("requested={DEFAULT_MAX_TOKENS},applied={FIT},reason=deadline,source=default")
                .as_str()
        )
    );
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["usage"]["completion_tokens"], FIT);
    assert_eq!(json["choices"][0]["finish_reason"], "length");
    assert_eq!(gw.upstream_completions()[0]["max_tokens"], FIT);

    // A stream has no window: the whole default goes upstream, unclamped.
    let response = send_ok(gw.complete(&body(None, true))).await;
    assert_eq!(clamp_header(&response), None);
    let text = response.text().await.unwrap();
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "{}",
        &text[text.len() - 200..]
    );
    assert_eq!(
        gw.upstream_completions()[1]["max_tokens"],
        DEFAULT_MAX_TOKENS
    );
}

#[tokio::test]
async fn the_default_window_lets_the_default_max_tokens_through() {
    // 600 s × 26 tokens/s = 15,600 tokens fit: more than any default the mock's context
    // of 8192 allows, so nothing is cut.
    let gw = Gateway::start().await;
    let response = send_ok(gw.complete(&body(None, false))).await;
    assert_eq!(clamp_header(&response), None);
    response.bytes().await.unwrap();
    assert_eq!(
        gw.upstream_completions()[0]["max_tokens"],
        DEFAULT_MAX_TOKENS
    );
}

#[tokio::test]
async fn a_budget_that_cuts_below_the_fit_is_named_with_the_deadline() {
    let gw = gateway(WINDOW_MS, RATE).await;
    // 43 tokens: 3 for the prompt, 40 left to generate (< the 70 that fit).
    let budget = LimitOverrides {
        monthly_budget: Some(43),
        ..LimitOverrides::default()
    };

    let (_, key) = gw.create_key(budget).await;
    let response = send_ok(gw.complete_as(&key, &body(None, false))).await;
    assert_eq!(
        clamp_header(&response).as_deref(),
        Some(
            format!(
                "requested={DEFAULT_MAX_TOKENS},applied=40,reason=deadline+budget,source=default"
            )
            .as_str()
        )
    );
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["usage"]["completion_tokens"], 40);
    assert_eq!(gw.upstream_completions()[0]["max_tokens"], 40);

    // An explicit max_tokens within the fit: only the budget cuts it.
    let (_, key) = gw.create_key(budget).await;
    let response = send_ok(gw.complete_as(&key, &body(Some(FIT), false))).await;
    assert_eq!(
        clamp_header(&response).as_deref(),
        Some(format!("requested={FIT},applied=40,reason=budget,source=client").as_str())
    );
    response.bytes().await.unwrap();
    assert_eq!(gw.upstream_completions()[1]["max_tokens"], 40);
}

#[tokio::test]
async fn an_explicit_max_tokens_over_the_fit_is_refused_unless_streamed() {
    let gw = gateway(WINDOW_MS, RATE).await;

    let response = send(gw.complete(&body(Some(FIT + 1), false))).await;
    assert_eq!(response.headers()["x-should-retry"], "false");
    assert!(response.headers().get("retry-after").is_none());
    let error = expect_error(response, 400, "deadline_infeasible").await;
    assert_eq!(error["error"]["param"], "max_tokens");
    assert_eq!(error["error"]["type"], "invalid_request_error");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("stream=true"), "{message}");
    assert!(message.contains(&FIT.to_string()), "{message}");
    assert!(
        gw.upstream_completions().is_empty(),
        "nothing was sent upstream"
    );
    let usage = gw.usage(&gw.key).await;
    assert_eq!(
        (usage["used"].as_u64(), usage["reserved"].as_u64()),
        (Some(0), Some(0))
    );

    // Exactly the fit is fine, and not clamped.
    let response = send_ok(gw.complete(&body(Some(FIT), false))).await;
    assert_eq!(clamp_header(&response), None);
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["usage"]["completion_tokens"], FIT);

    // The same request as a stream runs in full.
    let response = send_ok(gw.complete(&body(Some(FIT + 1), true))).await;
    assert_eq!(clamp_header(&response), None);
    let text = response.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(gw.upstream_completions()[1]["max_tokens"], FIT + 1);
}

#[tokio::test]
async fn an_upstream_that_overruns_the_window_is_cut_with_504_and_nothing_is_charged() {
    // 500 ms × 26 tokens/s: 13 tokens fit, so max_tokens 5 is accepted.
    let window = Duration::from_millis(500);
    let gw = gateway(window.as_millis() as u64, 26.0).await;
    let (key_id, key) = gw.key_with_slots(1, None).await;
    // The node takes both requests and holds them; its /health still answers, so the
    // prober keeps it in rotation.
    gw.mock.close_gate();
    let stream = tokio::spawn(gw.complete(&body(Some(5), true)).timeout(WAIT).send());
    let started = Instant::now();
    let held = tokio::spawn(
        gw.complete_as(&key, &body(Some(5), false))
            .timeout(WAIT)
            .send(),
    );
    tokio::time::timeout(WAIT, gw.mock.wait_in_flight(2))
        .await
        .expect("both requests reach the node");

    let response = held.await.unwrap().unwrap();
    let elapsed = started.elapsed();
    assert!(
        elapsed >= window,
        "cut after {elapsed:?}, before the window"
    );
    let headers = response.headers().clone();
    let error = expect_error(response, 504, "upstream_deadline").await;
    assert_eq!(headers["x-should-retry"], "false");
    assert!(headers.get("retry-after").is_none(), "{headers:?}");
    assert_eq!(headers["x-acs-upstream-error-kind"], "upstream_deadline");
    assert_eq!(error["error"]["type"], "server_error");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("stream=true"),
        "{error}"
    );

    // The generation was aborted upstream; the key's slot is free and nothing is
    // charged or reserved.
    tokio::time::timeout(WAIT, gw.mock.wait_cancelled(1))
        .await
        .expect("the upstream request was aborted");
    gw.wait_occupancy(key_id, 0, 0).await;
    let usage = gw.usage(&key).await;
    assert_eq!(usage["used"], 0, "{usage}");
    assert_eq!(usage["reserved"], 0, "{usage}");
    assert_eq!(usage["running"], 0, "{usage}");
    let metrics = gw.metrics_text().await;
    assert!(
        metrics.contains(&format!(
            r#"fleetgate_upstream_requests_total{{model="{MODEL}",gpu="gpu-a",outcome="deadline"}} 1"#
        )),
        "{metrics}"
    );

    // The stream has no window: it is still held upstream, and completes once the node
    // answers.
    assert_eq!(gw.mock.in_flight(), 1);
    assert!(!stream.is_finished());
    gw.mock.open_gate();
    let response = stream.await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");

    // The node stayed in rotation and the key runs its next request.
    let response = send_ok(gw.complete_as(&key, &body(Some(5), false))).await;
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["usage"]["completion_tokens"], 5);
    assert!(gw.usage(&key).await["used"].as_u64().unwrap() > 0);
}
