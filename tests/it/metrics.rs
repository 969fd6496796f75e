//! `GET /metrics`: no key needed, Prometheus text, the series and their labels after a
//! JSON completion, a stream, a 400 and a 429 — and no keys or prompts in it.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::{Gateway, MODEL, Sample, expect_error, parse_metrics};
use fleetgate::store::LimitOverrides;
use mock_vllm::FailureMode;
use serde_json::json;

/// The value of the series with exactly these labels (`None` if absent).
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    samples
        .iter()
        .find(|s| s.name == name && s.labels == want)
        .map(|s| s.value)
}

fn get(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    value(samples, name, labels)
        .unwrap_or_else(|| panic!("no series {name}{labels:?}; have {samples:#?}"))
}

const PROMPT: &str = "a private prompt about zanzibar";

#[tokio::test]
async fn metrics_count_requests_upstreams_and_refusals_without_keys_or_prompts() {
    let gw = Gateway::start().await;
    let mut prompt_tokens = 0.0;
    let mut completion_tokens = 0.0;

    // A JSON completion.
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).to_string();
    let response = gw.complete(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let json: serde_json::Value = response.json().await.unwrap();
    prompt_tokens += json["usage"]["prompt_tokens"].as_f64().unwrap();
    completion_tokens += json["usage"]["completion_tokens"].as_f64().unwrap();

    // A stream, with its usage frame.
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true}})
    .to_string();
    let response = gw.complete(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let usage = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
        .find_map(|frame| frame.get("usage").filter(|u| !u.is_null()).cloned())
        .expect("a usage frame");
    prompt_tokens += usage["prompt_tokens"].as_f64().unwrap();
    completion_tokens += usage["completion_tokens"].as_f64().unwrap();

    // A 400 for a model that does not exist: its name must not become a label.
    let body =
        json!({"model": "no-such-model-quokka", "prompt": PROMPT, "max_tokens": 1}).to_string();
    expect_error(
        gw.complete(&body).send().await.unwrap(),
        400,
        "model_not_found",
    )
    .await;

    // A 400 for a known model (a bad parameter): counted under that model.
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": -1}).to_string();
    expect_error(
        gw.complete(&body).send().await.unwrap(),
        400,
        "invalid_request",
    )
    .await;

    // A key with a rate of one request a minute: the first passes, the second is 429.
    let (_, limited) = gw
        .create_key(LimitOverrides {
            requests_per_minute: Some(1),
            ..LimitOverrides::default()
        })
        .await;
    let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}).to_string();
    let response = gw.complete_as(&limited, &body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let json: serde_json::Value = response.json().await.unwrap();
    prompt_tokens += json["usage"]["prompt_tokens"].as_f64().unwrap();
    completion_tokens += json["usage"]["completion_tokens"].as_f64().unwrap();
    expect_error(
        gw.complete_as(&limited, &body).send().await.unwrap(),
        429,
        "rate_limited",
    )
    .await;

    // Every settled request's usage row committed, so the ledger gauges read 0 below.
    gw.state.ledger().flush().await;

    // Scraped without a key.
    let response = gw
        .client
        .get(format!("{}/metrics", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"].to_str().unwrap();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let text = response.text().await.unwrap();
    let samples = parse_metrics(&text);

    // Privacy: no key secret or prefix, no prompt text, no client-chosen model name.
    for secret in [gw.key.as_str(), limited.as_str()] {
        let (prefix, _) = fleetgate::key_secret::parse_bearer(secret).expect("a well-formed key");
        assert!(!text.contains(secret), "a key secret in the scrape");
        assert!(!text.contains(prefix), "a key prefix in the scrape");
    }
    assert!(!text.contains("zanzibar"), "prompt text in the scrape");
    assert!(
        !text.contains("quokka"),
        "an unknown model name in the scrape"
    );

    assert_eq!(get(&samples, "fleetgate_ledger_pending_rows", &[]), 0.0);
    assert_eq!(get(&samples, "fleetgate_ledger_lost_rows", &[]), 0.0);

    let m = ("model", MODEL);
    let gpu = ("gpu", "gpu-a");
    let requests = "fleetgate_requests_total";
    assert_eq!(
        get(&samples, requests, &[m, ("status", "200"), ("code", "")]),
        3.0
    );
    assert_eq!(
        get(
            &samples,
            requests,
            &[m, ("status", "429"), ("code", "rate_limited")]
        ),
        1.0
    );
    assert_eq!(
        get(
            &samples,
            requests,
            &[
                ("model", ""),
                ("status", "400"),
                ("code", "model_not_found")
            ]
        ),
        1.0
    );
    assert_eq!(
        get(
            &samples,
            requests,
            &[m, ("status", "400"), ("code", "invalid_request")]
        ),
        1.0
    );
    assert_eq!(
        get(&samples, "fleetgate_request_duration_seconds_count", &[m]),
        5.0
    );
    assert!(get(&samples, "fleetgate_request_duration_seconds_sum", &[m]) > 0.0);
    assert_eq!(
        get(&samples, "fleetgate_prompt_tokens_total", &[m]),
        prompt_tokens
    );
    assert_eq!(
        get(&samples, "fleetgate_completion_tokens_total", &[m]),
        completion_tokens
    );
    assert_eq!(
        get(
            &samples,
            "fleetgate_upstream_requests_total",
            &[m, gpu, ("outcome", "ok")]
        ),
        3.0
    );
    assert_eq!(
        get(
            &samples,
            "fleetgate_upstream_time_to_first_byte_seconds_count",
            &[m, gpu]
        ),
        3.0
    );
    // Every answer is complete: nothing in flight, running or queued.
    assert_eq!(
        get(&samples, "fleetgate_in_flight_requests", &[m, gpu]),
        0.0
    );
    assert_eq!(get(&samples, "fleetgate_admission_running", &[]), 0.0);
    assert_eq!(get(&samples, "fleetgate_admission_queued", &[]), 0.0);
    assert_eq!(
        get(
            &samples,
            "fleetgate_admission_refusals_total",
            &[("reason", "rate_limited")]
        ),
        1.0
    );
}

#[tokio::test]
async fn gauges_follow_a_stream_and_its_queue_and_upstream_failures_count() {
    let gw = Gateway::start_slow(200).await;
    let scrape = || async { parse_metrics(&gw.metrics_text().await) };
    let m = ("model", MODEL);
    let gpu = ("gpu", "gpu-a");
    // Before any request, the configured upstream's gauge is there at zero.
    assert_eq!(
        get(&scrape().await, "fleetgate_in_flight_requests", &[m, gpu]),
        0.0
    );

    // One running slot and one queue place: a slow stream runs, the next request
    // waits, the one after is refused.
    let (key_id, key) = gw.key_with_slots(1, Some(1)).await;
    let body =
        json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 5, "stream": true}).to_string();
    let mut response = gw.complete_as(&key, &body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.chunk().await.unwrap().expect("a first chunk");
    let short = json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 1}).to_string();
    let waiting = tokio::spawn(gw.complete_as(&key, &short).send());
    gw.wait_occupancy(key_id, 1, 1).await;
    // The gauge follows the limiter's answer a moment later.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let during = loop {
        let samples = scrape().await;
        if get(&samples, "fleetgate_admission_queued", &[]) == 1.0 {
            break samples;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never counted as queued"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(get(&during, "fleetgate_in_flight_requests", &[m, gpu]), 1.0);
    assert_eq!(get(&during, "fleetgate_admission_running", &[]), 1.0);
    assert_eq!(get(&during, "fleetgate_admission_queued", &[]), 1.0);
    expect_error(
        gw.complete_as(&key, &short).send().await.unwrap(),
        429,
        "queue_full",
    )
    .await;

    // The client goes away mid-stream: the waiting request runs, then every gauge is
    // back at zero.
    drop(response);
    assert_eq!(waiting.await.unwrap().unwrap().status(), 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let after = scrape().await;
        if get(&after, "fleetgate_in_flight_requests", &[m, gpu]) == 0.0
            && get(&after, "fleetgate_admission_running", &[]) == 0.0
            && get(&after, "fleetgate_admission_queued", &[]) == 0.0
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the gauges never went back to zero"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // An upstream error status, then an upstream that cannot be reached.
    let body = json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 1}).to_string();
    gw.mock.set_failure(FailureMode::Status500);
    expect_error(
        gw.complete(&body).send().await.unwrap(),
        502,
        "upstream_error",
    )
    .await;
    gw.mock.set_failure(FailureMode::Refuse);
    expect_error(
        gw.complete(&body).send().await.unwrap(),
        503,
        "upstream_unavailable",
    )
    .await;
    let after = scrape().await;
    let outcome = |o| {
        get(
            &after,
            "fleetgate_upstream_requests_total",
            &[m, gpu, ("outcome", o)],
        )
    };
    assert_eq!(outcome("ok"), 2.0);
    assert_eq!(outcome("error_status"), 1.0);
    assert_eq!(outcome("unreachable"), 1.0);
    assert_eq!(get(&after, "fleetgate_in_flight_requests", &[m, gpu]), 0.0);
    assert_eq!(get(&after, "fleetgate_admission_running", &[]), 0.0);
    assert_eq!(
        get(
            &after,
            "fleetgate_admission_refusals_total",
            &[("reason", "queue_full")]
        ),
        1.0
    );
    assert_eq!(
        get(
            &after,
            "fleetgate_requests_total",
            &[m, ("status", "502"), ("code", "upstream_error")]
        ),
        1.0
    );
}
