//! Admission over HTTP (in-process counters): budget clamps and refusals, the per-key
//! queue, the rate limit, and slots coming back on every path.

use std::time::{Duration, Instant};

use crate::common::{Gateway, MODEL, expect_error};
use fleetgate::admission::Limiter;
use fleetgate::store::LimitOverrides;
use mock_vllm::{FailureMode, MockConfig};
use serde_json::json;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

fn budget(tokens: u64) -> LimitOverrides {
    LimitOverrides {
        monthly_budget: Some(tokens),
        ..LimitOverrides::default()
    }
}

/// A token-id prompt of `n` tokens: its cost is known exactly.
fn prompt(n: u32) -> Vec<u32> {
    (1..=n).collect()
}

#[tokio::test]
async fn a_request_over_budget_is_clamped_and_says_so_for_a_client_max_tokens() {
    let gw = Gateway::start().await;
    let (_, key) = gw.create_key(budget(100)).await;
    let body = json!({"model": MODEL, "prompt": prompt(10), "max_tokens": 200}).to_string();
    let response = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["x-acs-max-tokens-clamped"],
        "requested=200,applied=90,reason=budget,source=client"
    );
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["usage"]["completion_tokens"], 90);
    assert_eq!(gw.upstream_completions()[0]["max_tokens"], 90);
}

#[tokio::test]
async fn the_injected_default_is_clamped_with_source_default() {
    let gw = Gateway::start_with(
        MockConfig {
            max_model_len: 4096,
            ..MockConfig::default()
        },
        "",
    )
    .await;
    let (_, key) = gw.create_key(budget(1000)).await;
    let body = json!({"model": MODEL, "prompt": prompt(10), "stream": true}).to_string();
    let response = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(
        response.headers()["x-acs-max-tokens-clamped"],
        "requested=4086,applied=990,reason=budget,source=default"
    );
    response.text().await.unwrap();
    assert_eq!(gw.upstream_completions()[0]["max_tokens"], 990);
}

#[tokio::test]
async fn an_unclamped_request_has_no_clamp_header() {
    let gw = Gateway::start().await;
    let body = json!({"model": MODEL, "prompt": prompt(3), "max_tokens": 5}).to_string();
    let response = gw.complete(&body).send().await.unwrap();
    assert!(response.headers().get("x-acs-max-tokens-clamped").is_none());
    assert_eq!(gw.upstream_completions()[0]["max_tokens"], 5);
}

#[tokio::test]
async fn a_used_up_budget_is_429_budget_exceeded_and_not_retryable() {
    let gw = Gateway::start().await;
    let (key_id, key) = gw.create_key(budget(20)).await;
    let body = json!({"model": MODEL, "prompt": prompt(10), "max_tokens": 10}).to_string();
    let first = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(first.status(), 200);
    first.bytes().await.unwrap();
    gw.wait_occupancy(key_id, 0, 0).await;
    assert_eq!(gw.usage(&key).await["used"], 20);
    let response = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(response.headers()["x-should-retry"], "false");
    assert!(
        response.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 0
    );
    expect_error(response, 429, "budget_exceeded").await;
    assert_eq!(gw.upstream_completions().len(), 1);
}

/// A budget with a few tokens left, too few for the request: the refusal says how many
/// are left (not "used up"), and names no GPU node, since nothing went upstream.
#[tokio::test]
async fn a_budget_refusal_says_what_is_left_and_names_no_node() {
    let gw = Gateway::start().await;
    let (key_id, key) = gw.create_key(budget(28)).await;
    let body = json!({"model": MODEL, "prompt": prompt(10), "max_tokens": 10}).to_string();
    let first = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(first.status(), 200);
    assert!(first.headers().contains_key("x-acs-upstream-gpu"));
    first.bytes().await.unwrap();
    gw.wait_occupancy(key_id, 0, 0).await;
    // 8 left; the next needs its 10 prompt tokens and at least one more.
    let response = gw.complete_as(&key, &body).send().await.unwrap();
    assert!(
        !response.headers().contains_key("x-acs-upstream-gpu"),
        "{:?}",
        response.headers()
    );
    let body = expect_error(response, 429, "budget_exceeded").await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("has 8 left"), "{message}");
    assert!(!message.contains("used up"), "{message}");
}

#[tokio::test]
async fn concurrent_requests_never_exceed_the_budget() {
    let gw = Gateway::start().await;
    let (key_id, key) = gw.create_key(budget(1000)).await;
    gw.mock.close_gate();
    let body = json!({"model": MODEL, "prompt": prompt(10), "max_tokens": 90}).to_string();
    let requests: Vec<_> = (0..16)
        .map(|_| {
            let request = gw.complete_as(&key, &body);
            tokio::spawn(async move { request.send().await.unwrap() })
        })
        .collect();
    // Ten fit (10 + 90 each); the others are refused while those ten hold their budget.
    gw.mock.wait_in_flight(10).await;
    let usage = gw.usage(&key).await;
    assert_eq!(usage["reserved"], 1000);
    assert_eq!(usage["remaining"], 0);
    assert_eq!(usage["monthly_budget"], 1000, "the one name of the budget");
    assert_eq!(
        usage["budget"], 1000,
        "its first name, kept for existing clients"
    );
    gw.mock.open_gate();
    let mut statuses = Vec::new();
    for request in requests {
        let response = request.await.unwrap();
        statuses.push(response.status().as_u16());
        response.bytes().await.unwrap();
    }
    statuses.sort();
    assert_eq!(statuses, [[200; 10].as_slice(), &[429; 6]].concat());
    gw.wait_occupancy(key_id, 0, 0).await;
    let usage = gw.usage(&key).await;
    assert_eq!(usage["used"], 1000);
    assert_eq!(usage["reserved"], 0);
}

#[tokio::test]
async fn sixteen_run_sixty_four_wait_and_the_rest_are_refused() {
    let gw = Gateway::start().await;
    let (key_id, key) = gw.create_key(LimitOverrides::default()).await;
    gw.mock.close_gate();
    let body = json!({"model": MODEL, "prompt": prompt(2), "max_tokens": 1}).to_string();
    let send = |_| {
        let request = gw.complete_as(&key, &body);
        tokio::spawn(async move { request.send().await.unwrap().status().as_u16() })
    };
    let running: Vec<_> = (0..16).map(send).collect();
    gw.mock.wait_in_flight(16).await;
    let waiting: Vec<_> = (0..64).map(send).collect();
    gw.wait_occupancy(key_id, 16, 64).await;
    let refused = gw.complete_as(&key, &body).send().await.unwrap();
    assert!(refused.headers().contains_key("retry-after"));
    let error = expect_error(refused, 429, "queue_full").await;
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("16 requests running and 64 waiting")
    );
    assert_eq!(
        gw.mock.in_flight(),
        16,
        "the waiting ones did not reach the upstream"
    );
    gw.mock.open_gate();
    for handle in running.into_iter().chain(waiting) {
        assert_eq!(timeout(WAIT, handle).await.unwrap().unwrap(), 200);
    }
    gw.wait_occupancy(key_id, 0, 0).await;
}

#[tokio::test]
async fn waiting_requests_start_in_arrival_order() {
    let gw = Gateway::start().await;
    let (key_id, key) = gw.key_with_slots(1, None).await;
    gw.mock.close_gate();
    let send = |i: u32| {
        let body = json!({"model": MODEL, "prompt": prompt(i + 1), "max_tokens": 1}).to_string();
        let request = gw.complete_as(&key, &body);
        tokio::spawn(async move { request.send().await.unwrap().status().as_u16() })
    };
    let mut handles = vec![send(0)];
    gw.wait_occupancy(key_id, 1, 0).await;
    for i in 1..5 {
        handles.push(send(i));
        gw.wait_occupancy(key_id, 1, i).await;
    }
    gw.mock.open_gate();
    for handle in handles {
        assert_eq!(handle.await.unwrap(), 200);
    }
    // The upstream saw the prompts (of 1, 2, 3, 4, 5 tokens) in the order they queued.
    let lengths: Vec<usize> = gw
        .upstream_completions()
        .iter()
        .map(|b| b["prompt"].as_array().unwrap().len())
        .collect();
    assert_eq!(lengths, [1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn a_waiting_client_that_disconnects_leaves_the_queue() {
    let gw = Gateway::start().await;
    let (key_id, key) = gw.key_with_slots(1, Some(1)).await;
    gw.mock.close_gate();
    let body = json!({"model": MODEL, "prompt": prompt(2), "max_tokens": 1}).to_string();
    let first = {
        let request = gw.complete_as(&key, &body);
        tokio::spawn(async move { request.send().await.unwrap().status().as_u16() })
    };
    gw.wait_occupancy(key_id, 1, 0).await;
    let waiter = {
        let request = gw.complete_as(&key, &body);
        tokio::spawn(async move { request.send().await })
    };
    gw.wait_occupancy(key_id, 1, 1).await;
    waiter.abort();
    gw.wait_occupancy(key_id, 1, 0).await;
    let next = {
        let request = gw.complete_as(&key, &body);
        tokio::spawn(async move { request.send().await.unwrap().status().as_u16() })
    };
    gw.wait_occupancy(key_id, 1, 1).await;
    gw.mock.open_gate();
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(next.await.unwrap(), 200);
}

#[tokio::test]
async fn the_rate_limit_trips_at_the_configured_rate_not_before() {
    let gw = Gateway::start().await;
    let (_, key) = gw
        .create_key(LimitOverrides {
            requests_per_minute: Some(60),
            ..LimitOverrides::default()
        })
        .await;
    let body = json!({"model": MODEL, "prompt": prompt(2), "max_tokens": 1}).to_string();
    let start = Instant::now();
    let mut allowed = 0u64;
    let refused = loop {
        let response = gw.complete_as(&key, &body).send().await.unwrap();
        if response.status() == 429 {
            break response;
        }
        assert_eq!(response.status(), 200);
        allowed += 1;
        assert!(allowed <= 200, "never refused");
    };
    // 60 at once, plus one per second that passed while sending them.
    let elapsed = start.elapsed().as_secs();
    assert!(
        (60..=61 + elapsed).contains(&allowed),
        "{allowed} allowed in {elapsed} s"
    );
    assert!(
        refused.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            <= 1
    );
    expect_error(refused, 429, "rate_limited").await;
}

#[tokio::test]
async fn slots_come_back_after_an_upstream_failure_and_cost_nothing() {
    // No probes: this test is about slots, not about when the node is re-admitted.
    let gw = Gateway::start_with(
        MockConfig::default(),
        "[fleet]\nprobe_interval_ms = 3600000",
    )
    .await;
    let (key_id, key) = gw.key_with_slots(1, Some(0)).await;
    let body = json!({"model": MODEL, "prompt": prompt(5), "max_tokens": 5}).to_string();
    gw.mock.set_failure(FailureMode::Status500);
    let failed = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(failed.status(), 502);
    // The slot is free by the time the error arrives: an immediate retry is admitted.
    let free = (0, 0);
    assert_eq!(gw.limiter.occupancy(key_id).await.unwrap(), free);
    gw.mock.set_failure(FailureMode::Refuse);
    let refused = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(gw.limiter.occupancy(key_id).await.unwrap(), free);
    gw.mock.set_failure(FailureMode::None);
    assert_eq!(
        gw.complete_as(&key, &body).send().await.unwrap().status(),
        200
    );
    gw.wait_occupancy(key_id, 0, 0).await;
    assert_eq!(
        gw.usage(&key).await["used"],
        10,
        "only the served request was charged"
    );
}

#[tokio::test]
async fn a_stream_whose_client_vanished_frees_its_slot_and_is_charged_what_was_generated() {
    let gw = Gateway::start_slow(50).await;
    let (key_id, key) = gw.key_with_slots(1, Some(0)).await;
    let body =
        json!({"model": MODEL, "prompt": prompt(5), "max_tokens": 500, "stream": true}).to_string();
    let mut response = gw.complete_as(&key, &body).send().await.unwrap();
    let mut frames = 0;
    while frames < 3 {
        let chunk = timeout(WAIT, response.chunk())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        frames += chunk.windows(6).filter(|w| w == b"data: ").count();
    }
    drop(response);
    timeout(WAIT, gw.mock.wait_cancelled(1)).await.unwrap();
    gw.wait_occupancy(key_id, 0, 0).await;
    let used = gw.usage(&key).await["used"].as_u64().unwrap();
    assert!(
        used >= 5 + 3,
        "charged at least the prompt and the frames relayed: {used}"
    );
    assert!(used < 5 + 500, "charged less than the worst case: {used}");
    // The slot is free: the next request runs at once instead of 429 queue_full.
    let next = json!({"model": MODEL, "prompt": prompt(5), "max_tokens": 1}).to_string();
    assert_eq!(
        gw.complete_as(&key, &next).send().await.unwrap().status(),
        200
    );
}

#[tokio::test]
async fn streams_are_metered_and_the_usage_frame_is_only_sent_when_asked_for() {
    let gw = Gateway::start().await;
    let (key_id, key) = gw.create_key(LimitOverrides::default()).await;
    let body =
        json!({"model": MODEL, "prompt": prompt(4), "max_tokens": 6, "stream": true}).to_string();
    let text = gw
        .complete_as(&key, &body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!text.contains("\"choices\":[]"), "no usage frame: {text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(
        gw.upstream_completions()[0]["stream_options"],
        json!({"include_usage": true}),
        "the upstream is always asked for usage"
    );
    gw.wait_occupancy(key_id, 0, 0).await;
    assert_eq!(gw.usage(&key).await["used"], 10);
}

#[tokio::test]
async fn a_client_with_the_whole_answer_finds_its_slot_free_and_its_usage_counted() {
    let gw = Gateway::start().await;
    let (_, key) = gw.key_with_slots(1, Some(0)).await;
    for (i, stream) in [false, true].into_iter().cycle().take(20).enumerate() {
        let body = json!({"model": MODEL, "prompt": prompt(4), "max_tokens": 1, "stream": stream})
            .to_string();
        let response = gw.complete_as(&key, &body).send().await.unwrap();
        assert_eq!(response.status(), 200, "request {i} found the slot taken");
        response.bytes().await.unwrap();
        assert_eq!(gw.usage(&key).await["used"], 5 * (i + 1));
    }
}

#[tokio::test]
async fn with_limits_off_nothing_is_clamped_or_refused_but_usage_is_still_metered() {
    let mock = mock_vllm::MockVllm::start(MockConfig::default())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = fleetgate::config::Config::from_toml(&format!(
        "database_url = \"sqlite://{}/fg.db\"\n[limits]\nenabled = false\nmonthly_budget = 10\nrequests_per_minute = 1\n[[models]]\nid = \"{MODEL}\"\n[[models.upstreams]]\nurl = \"{}\"\ngpu = \"g\"\n",
        dir.path().display(),
        mock.url()
    ))
    .unwrap();
    let state = fleetgate::server::prepare(config).await.unwrap();
    let key = fleetgate::key_secret::generate();
    state
        .store()
        .create_key("k", None, &key, &LimitOverrides::default())
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(fleetgate::server::serve(
        state,
        listener,
        std::future::pending(),
    ));
    let client = reqwest::Client::new();
    let body = json!({"model": MODEL, "prompt": prompt(10), "max_tokens": 20}).to_string();
    for _ in 0..3 {
        let response = client
            .post(format!("{url}/v1/completions"))
            .bearer_auth(key.secret.expose())
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert!(response.headers().get("x-acs-max-tokens-clamped").is_none());
        response.bytes().await.unwrap();
    }
    let usage: serde_json::Value = client
        .get(format!("{url}/v1/usage"))
        .bearer_auth(key.secret.expose())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        usage["used"], 90,
        "three requests of 10 + 20 tokens, read from the ledger"
    );
}
