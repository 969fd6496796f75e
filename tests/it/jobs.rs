//! Completion jobs over HTTP, in process: submission (`Prefer: respond-async`) checked
//! like a synchronous call, idempotency keys, harvest long-polls and their bounds,
//! cancels, ownership, retention and the key's budget and rate. The multi-process
//! cases (SIGKILL, restarts, two replicas) are in `tests/replicas.rs` and
//! `tests/binary.rs`.

use std::time::{Duration, Instant};

use crate::common::{self, Gateway, MODEL, expect_error, parse_metrics};
use fleetgate::admission::Month;
use fleetgate::state::AppState;
use fleetgate::store::{LimitOverrides, now_unix_ms};
use mock_vllm::MockConfig;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);

fn body(prompt: &str, max_tokens: u32) -> String {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).to_string()
}

/// `POST /v1/completions` as a job of `key`, with further headers.
async fn submit_as(
    gw: &Gateway,
    key: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut request = gw.complete_as(key, body).header("prefer", "respond-async");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

/// Submits and returns the job's id, checking the 202's shape.
async fn submit(gw: &Gateway, body: &str) -> String {
    let response = submit_as(gw, &gw.key, body, &[]).await;
    assert_eq!(response.status(), 202);
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    assert_eq!(response.headers()["preference-applied"], "respond-async");
    let job: Value = response.json().await.unwrap();
    assert_eq!(job["object"], "completion.job");
    assert_eq!(job["status"], "queued");
    assert_eq!(
        location,
        format!("/v1/harvest/{}", job["id"].as_str().unwrap())
    );
    job["id"].as_str().unwrap().to_owned()
}

async fn harvest_as(gw: &Gateway, key: &str, id: &str, query: &str) -> reqwest::Response {
    gw.client
        .get(format!("{}/v1/harvest/{id}{query}", gw.url))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
}

/// Long-polls until the job of the test key has ended (each poll waits up to 10 s).
async fn ended(gw: &Gateway, id: &str) -> Value {
    ended_as(gw, &gw.key, id).await
}

/// [`ended`] for a job of `key`.
async fn ended_as(gw: &Gateway, key: &str, id: &str) -> Value {
    ended_at(&gw.client, &gw.url, key, id).await
}

/// [`ended_as`] on the gateway at `url`.
async fn ended_at(client: &reqwest::Client, url: &str, key: &str, id: &str) -> Value {
    let since = Instant::now();
    loop {
        let response = client
            .get(format!("{url}/v1/harvest/{id}?wait=10"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let job: Value = response.json().await.unwrap();
        if !matches!(job["status"].as_str(), Some("queued" | "running")) {
            return job;
        }
        assert!(since.elapsed() < 3 * WAIT, "job {id} never ended: {job}");
    }
}

/// `GET /v1/harvest` (the first page) as `key`.
async fn list_as(gw: &Gateway, key: &str) -> Value {
    let response = gw
        .client
        .get(format!("{}/v1/harvest", gw.url))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// `DELETE /v1/harvest/{id}` as `key`.
async fn cancel_as(gw: &Gateway, key: &str, id: &str) -> reqwest::Response {
    gw.client
        .delete(format!("{}/v1/harvest/{id}", gw.url))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
}

/// A gateway whose jobs settings are `jobs` (TOML keys of `[jobs]`).
async fn with_jobs(mock: MockConfig, jobs: &str) -> Gateway {
    Gateway::start_with(mock, &format!("[jobs]\n{jobs}\n")).await
}

#[tokio::test]
async fn a_job_runs_once_and_its_result_is_the_body_a_synchronous_call_gets() {
    let gw = Gateway::start().await;
    let id = submit(&gw, &body("Once upon a time", 5)).await;
    let job = ended(&gw, &id).await;
    assert_eq!(job["status"], "succeeded", "{job}");
    assert_eq!(job["attempts"], 1);
    assert!(job["error"].is_null());
    let result = &job["result"];
    assert_eq!(result["object"], "text_completion");
    assert_eq!(result["usage"]["completion_tokens"], 5);
    assert!(job["finished_at"].as_i64().unwrap() >= job["created_at"].as_i64().unwrap());

    // The same request made synchronously: the same shape, the same text.
    let sync: Value = gw
        .complete(&body("Once upon a time", 5))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(result["choices"][0]["text"], sync["choices"][0]["text"]);
    assert_eq!(result["usage"], sync["usage"]);

    // Ran once upstream (plus the synchronous call), as a batch request; charged once.
    assert_eq!(gw.upstream_completions().len(), 2);
    let used = gw.usage(&gw.key).await["used"].as_u64().unwrap();
    let per_call = result["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(used, 2 * per_call);
}

#[tokio::test]
async fn a_submission_is_checked_like_a_synchronous_call() {
    let gw = Gateway::start().await;
    let streamed =
        json!({"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": true}).to_string();
    let refused = expect_error(
        submit_as(&gw, &gw.key, &streamed, &[]).await,
        400,
        "invalid_request",
    )
    .await;
    assert_eq!(refused["error"]["param"], "stream");
    let unknown = json!({"model": MODEL, "prompt": "x", "colour": "red"}).to_string();
    expect_error(
        submit_as(&gw, &gw.key, &unknown, &[]).await,
        400,
        "invalid_request",
    )
    .await;
    let wrong_model = json!({"model": "gpt-9", "prompt": "x"}).to_string();
    expect_error(
        submit_as(&gw, &gw.key, &wrong_model, &[]).await,
        400,
        "model_not_found",
    )
    .await;
    expect_error(
        submit_as(&gw, "fg-not-a-key", &body("x", 2), &[]).await,
        401,
        "invalid_api_key",
    )
    .await;
    assert!(
        gw.state
            .store()
            .jobs()
            .list(&fleetgate::store::JobQuery {
                key_id: Some(1),
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap()
            .is_empty()
    );
    assert!(gw.upstream_completions().is_empty());
}

#[tokio::test]
async fn the_budget_and_the_rate_of_a_key_apply_at_submission() {
    let gw = Gateway::start().await;
    let (_, poor) = gw
        .create_key(LimitOverrides {
            monthly_budget: Some(10),
            ..LimitOverrides::default()
        })
        .await;
    let token_prompt =
        json!({"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "max_tokens": 1})
            .to_string();
    let refused = submit_as(&gw, &poor, &token_prompt, &[]).await;
    assert_eq!(refused.headers()["x-should-retry"], "false");
    expect_error(refused, 429, "budget_exceeded").await;

    let (_, slow) = gw
        .create_key(LimitOverrides {
            requests_per_minute: Some(3),
            ..LimitOverrides::default()
        })
        .await;
    for _ in 0..3 {
        assert_eq!(
            submit_as(&gw, &slow, &body("x", 1), &[]).await.status(),
            202
        );
    }
    let limited = submit_as(&gw, &slow, &body("x", 1), &[]).await;
    assert!(limited.headers().contains_key("retry-after"));
    expect_error(limited, 429, "rate_limited").await;
    // The runs are not counted against the rate again: the three run at once, and the
    // only rate refusal is the submission's.
    let list = list_as(&gw, &slow).await;
    let started = Instant::now();
    for job in list["data"].as_array().unwrap() {
        let job = ended_as(&gw, &slow, job["id"].as_str().unwrap()).await;
        assert_eq!(job["status"], "succeeded", "{job}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the runs waited for the rate"
    );
    let refusals = parse_metrics(&gw.metrics_text().await)
        .into_iter()
        .filter(|s| {
            s.name == "fleetgate_admission_refusals_total" && s.labels["reason"] == "rate_limited"
        })
        .map(|s| s.value)
        .sum::<f64>();
    assert_eq!(refusals, 1.0);
}

#[tokio::test]
async fn a_run_is_admitted_against_the_budget_as_it_stands_when_it_runs() {
    // One worker, busy with another key's job while this key submits two jobs that each
    // fit its budget of 30 tokens, but not both: the second one's run is refused.
    let gw = with_jobs(
        MockConfig {
            token_delay: Duration::from_millis(20),
            ..MockConfig::default()
        },
        "workers = 1",
    )
    .await;
    let blocker = submit(&gw, &body("blocks the worker", 40)).await;
    let (_, key) = gw
        .create_key(LimitOverrides {
            monthly_budget: Some(30),
            ..LimitOverrides::default()
        })
        .await;
    let twenty =
        json!({"model": MODEL, "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_tokens": 10})
            .to_string();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let response = submit_as(&gw, &key, &twenty, &[]).await;
        assert_eq!(response.status(), 202);
        ids.push(
            response.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert_eq!(ended(&gw, &blocker).await["status"], "succeeded");
    assert_eq!(ended_as(&gw, &key, &ids[0]).await["status"], "succeeded");
    let second = ended_as(&gw, &key, &ids[1]).await;
    assert_eq!(second["status"], "failed", "{second}");
    assert_eq!(
        second["error"]["error"]["code"], "budget_exceeded",
        "{second}"
    );
    assert_eq!(gw.usage(&key).await["used"], 20);
}

#[tokio::test]
async fn an_idempotency_key_returns_the_same_job_and_refuses_another_body() {
    let gw = Gateway::start().await;
    let (_, other_key) = gw.create_key(LimitOverrides::default()).await;
    let keyed = |key: &str, prompt: &str, idempotency_key: &'static str| {
        let (gw, key, body) = (&gw, key.to_owned(), body(prompt, 2));
        async move { submit_as(gw, &key, &body, &[("idempotency-key", idempotency_key)]).await }
    };
    const IKEY: &str = "\"batch-7-item-1\"";
    let first = keyed(&gw.key, "same", IKEY).await;
    assert_eq!(first.status(), 202);
    let first: Value = first.json().await.unwrap();
    let again = keyed(&gw.key, "same", IKEY).await;
    assert_eq!(again.status(), 200);
    let location = again.headers()["location"].to_str().unwrap().to_owned();
    assert!(location.ends_with(first["id"].as_str().unwrap()));
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["id"], first["id"]);
    let other = keyed(&gw.key, "different", IKEY).await;
    expect_error(other, 422, "idempotency_key_reused").await;
    // Another key has idempotency keys of its own.
    assert_eq!(keyed(&other_key, "different", IKEY).await.status(), 202);
    let bad = keyed(&gw.key, "same", "\"\"").await;
    expect_error(bad, 400, "invalid_request").await;
    ended(&gw, first["id"].as_str().unwrap()).await;
    let ran = gw
        .upstream_completions()
        .iter()
        .filter(|b| b["prompt"] == "same")
        .count();
    assert_eq!(ran, 1, "one job, run once");
}

#[tokio::test]
async fn another_keys_job_is_not_found() {
    let gw = Gateway::start().await;
    let id = submit(&gw, &body("mine", 2)).await;
    let (_, other) = gw.create_key(LimitOverrides::default()).await;
    expect_error(harvest_as(&gw, &other, &id, "").await, 404, "job_not_found").await;
    let cancel = cancel_as(&gw, &other, &id).await;
    expect_error(cancel, 404, "job_not_found").await;
    let list = list_as(&gw, &other).await;
    assert_eq!(list["data"], json!([]));
    expect_error(
        harvest_as(&gw, &gw.key, "job_nope", "").await,
        404,
        "job_not_found",
    )
    .await;
    assert_eq!(ended(&gw, &id).await["status"], "succeeded");
}

#[tokio::test]
async fn wait_must_be_whole_seconds_from_zero_to_sixty() {
    let gw = Gateway::start().await;
    let id = submit(&gw, &body("x", 1)).await;
    for query in ["?wait=61", "?wait=-1", "?wait=1.5", "?wait=soon"] {
        let refused = expect_error(
            harvest_as(&gw, &gw.key, &id, query).await,
            400,
            "invalid_request",
        )
        .await;
        assert_eq!(refused["error"]["param"], "wait", "{query}");
    }
    expect_error(
        harvest_as(&gw, &gw.key, &id, "?timeout=5").await,
        400,
        "invalid_request",
    )
    .await;
    assert_eq!(harvest_as(&gw, &gw.key, &id, "?wait=0").await.status(), 200);
}

#[tokio::test]
async fn a_long_poll_wakes_within_100_ms_of_the_end() {
    // 20 tokens 40 ms apart: the job runs for about 0.8 s.
    let gw = Gateway::start_slow(40).await;
    let id = submit(&gw, &body("slow", 20)).await;
    let polled = Instant::now();
    let response = harvest_as(&gw, &gw.key, &id, "?wait=30").await;
    let answered_ms = fleetgate::store::now_unix_ms();
    let job: Value = response.json().await.unwrap();
    assert_eq!(job["status"], "succeeded");
    assert!(polled.elapsed() < Duration::from_secs(10));
    let row = gw.state.store().jobs().any_job(&id).await.unwrap().unwrap();
    let late = answered_ms - row.finished_at_ms.unwrap();
    assert!(
        (0..100).contains(&late),
        "answered {late} ms after the job ended"
    );
}

#[tokio::test]
async fn a_long_poll_ends_after_its_wait_with_the_current_state() {
    let gw = with_jobs(MockConfig::default(), "workers = 0").await;
    let id = submit(&gw, &body("never runs", 2)).await;
    let polled = Instant::now();
    let job: Value = harvest_as(&gw, &gw.key, &id, "?wait=1")
        .await
        .json()
        .await
        .unwrap();
    assert!(polled.elapsed() >= Duration::from_secs(1));
    assert_eq!(job["status"], "queued");
}

#[tokio::test]
async fn too_many_long_polls_are_declined_with_a_jittered_retry_after() {
    let gw = with_jobs(
        MockConfig::default(),
        "workers = 0\nmax_waiters_per_key = 1",
    )
    .await;
    let id = submit(&gw, &body("waits", 2)).await;
    let waiting = {
        let (client, url, key, id) = (
            gw.client.clone(),
            gw.url.clone(),
            gw.key.clone(),
            id.clone(),
        );
        tokio::spawn(async move {
            client
                .get(format!("{url}/v1/harvest/{id}?wait=20"))
                .bearer_auth(key)
                .send()
                .await
                .unwrap()
        })
    };
    // Until the first long-poll is counted as waiting.
    let since = Instant::now();
    while !parse_metrics(&gw.metrics_text().await)
        .iter()
        .any(|s| s.name == "fleetgate_harvest_waiting" && s.value == 1.0)
    {
        assert!(since.elapsed() < WAIT, "the first long-poll never waited");
        tokio::task::yield_now().await;
    }
    let declined = harvest_as(&gw, &gw.key, &id, "?wait=20").await;
    assert_eq!(declined.status(), 200);
    assert_eq!(declined.headers()["x-acs-longpoll"], "declined");
    let retry: u64 = declined.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=5).contains(&retry), "{retry}");
    assert_eq!(declined.json::<Value>().await.unwrap()["status"], "queued");
    // Another key is not held back by this one's long-polls.
    let (_, other) = gw.create_key(LimitOverrides::default()).await;
    let theirs = submit_as(&gw, &other, &body("theirs", 1), &[])
        .await
        .json::<Value>()
        .await
        .unwrap();
    let quick = harvest_as(&gw, &other, theirs["id"].as_str().unwrap(), "?wait=1").await;
    assert!(!quick.headers().contains_key("x-acs-longpoll"));
    // The waiting one is answered when its job ends: cancel it.
    cancel_as(&gw, &gw.key, &id).await;
    let answered = tokio::time::timeout(WAIT, waiting).await.unwrap().unwrap();
    assert_eq!(
        answered.json::<Value>().await.unwrap()["status"],
        "cancelled"
    );
    let metrics = parse_metrics(&gw.metrics_text().await);
    assert!(
        metrics
            .iter()
            .any(|s| s.name == "fleetgate_harvest_declined_total" && s.value == 1.0)
    );
}

#[tokio::test]
async fn a_cancelled_queued_job_never_runs() {
    let gw = with_jobs(MockConfig::default(), "workers = 0").await;
    let id = submit(&gw, &body("cancel me", 2)).await;
    let cancel = cancel_as(&gw, &gw.key, &id).await;
    assert_eq!(cancel.status(), 200);
    let job: Value = cancel.json().await.unwrap();
    assert_eq!(job["status"], "cancelled");
    assert!(job["result"].is_null());
    assert_eq!(job["error"]["error"]["code"], "job_cancelled");
    assert_eq!(job["error"]["request_id"], id.as_str());
    assert!(gw.upstream_completions().is_empty());
}

#[tokio::test]
async fn a_cancelled_running_job_stops_upstream_and_ends_cancelled() {
    // 200 tokens 50 ms apart: 10 s if it were left to run.
    let gw = Gateway::start_slow(50).await;
    let id = submit(&gw, &body("long", 200)).await;
    tokio::time::timeout(WAIT, gw.mock.wait_in_flight(1))
        .await
        .unwrap();
    let cancelled_at = Instant::now();
    let cancel: Value = cancel_as(&gw, &gw.key, &id).await.json().await.unwrap();
    assert_eq!(cancel["status"], "running");
    assert_eq!(cancel["cancel_requested"], true);
    let job = ended(&gw, &id).await;
    assert_eq!(job["status"], "cancelled");
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(5),
        "ended {:?} after the cancel",
        cancelled_at.elapsed()
    );
    tokio::time::timeout(WAIT, gw.mock.wait_cancelled(1))
        .await
        .unwrap();
    // Charged for what it used: at least its prompt.
    let usage = gw.usage(&gw.key).await;
    assert!(usage["used"].as_u64().unwrap() > 0, "{usage}");
}

#[tokio::test]
async fn jobs_are_listed_newest_first_by_page_and_status() {
    let gw = with_jobs(MockConfig::default(), "workers = 0").await;
    let mut ids = Vec::new();
    for n in 0..3 {
        ids.push(submit(&gw, &body(&format!("p{n}"), 1)).await);
    }
    cancel_as(&gw, &gw.key, &ids[0]).await;
    let page: Value = gw.get_json("/v1/harvest?limit=2").await;
    assert_eq!(page["object"], "list");
    assert_eq!(page["data"][0]["id"], ids[2].as_str());
    assert_eq!(page["data"][1]["id"], ids[1].as_str());
    assert_eq!(page["has_more"], true);
    let next: Value = gw
        .get_json(&format!(
            "/v1/harvest?limit=2&after={}",
            page["last_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(next["data"][0]["id"], ids[0].as_str());
    assert_eq!(next["has_more"], false);
    let cancelled: Value = gw.get_json("/v1/harvest?status=cancelled").await;
    assert_eq!(cancelled["data"].as_array().unwrap().len(), 1);
    expect_error(
        gw.get("/v1/harvest?limit=0").send().await.unwrap(),
        400,
        "invalid_request",
    )
    .await;
    expect_error(
        gw.get("/v1/harvest?status=lost").send().await.unwrap(),
        400,
        "invalid_request",
    )
    .await;
}

#[tokio::test]
async fn an_unrun_job_expires_and_an_ended_jobs_content_is_deleted() {
    // Test durations: a queued job expires after 300 ms, content goes 300 ms after the
    // end; the sweep runs every 50 ms.
    let gw = with_jobs(
        MockConfig::default(),
        "workers = 0\nqueued_ttl_ms = 300\ncontent_ttl_ms = 300\nsweep_interval_ms = 50",
    )
    .await;
    let id = submit(&gw, &body("forgotten", 1)).await;
    let job = ended(&gw, &id).await;
    assert_eq!(job["status"], "expired");
    assert_eq!(job["error"]["error"]["code"], "job_expired");
    assert!(gw.upstream_completions().is_empty());
    let row = gw.state.store().jobs().any_job(&id).await.unwrap().unwrap();
    assert_eq!(row.request, None, "an expired job's request is deleted");

    let ran = Gateway::start_with(
        MockConfig::default(),
        "[jobs]\ncontent_ttl_ms = 300\nsweep_interval_ms = 50\n",
    )
    .await;
    let id = submit(&ran, &body("kept a while", 1)).await;
    assert!(ended(&ran, &id).await["result"].is_object());
    let since = Instant::now();
    loop {
        let job: Value = harvest_as(&ran, &ran.key, &id, "")
            .await
            .json()
            .await
            .unwrap();
        if job["result"].is_null() {
            assert_eq!(job["status"], "succeeded", "the status stays");
            break;
        }
        assert!(since.elapsed() < WAIT, "the result was never deleted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_failed_run_carries_the_envelope_a_synchronous_call_gets() {
    // max_tokens beyond the context: vLLM's 400, passed on.
    let gw = Gateway::start().await;
    let too_long = json!({"model": MODEL, "prompt": "x", "max_tokens": 9000}).to_string();
    let sync = gw.complete(&too_long).send().await.unwrap();
    let sync_status = sync.status().as_u16();
    let sync: Value = sync.json().await.unwrap();
    let id = submit(&gw, &too_long).await;
    let job = ended(&gw, &id).await;
    assert_eq!(job["status"], "failed", "{job}");
    assert_eq!(
        job["error"]["error"]["code"], sync["error"]["code"],
        "{job}"
    );
    assert_eq!(job["error"]["error"]["message"], sync["error"]["message"]);
    assert!(
        job["error"]["request_id"]
            .as_str()
            .unwrap()
            .starts_with(&id)
    );
    assert!(sync_status >= 400);
    assert_eq!(
        job["attempts"], 1,
        "a run that reached a node is not run again"
    );
}

#[tokio::test]
async fn a_run_that_never_reached_a_node_is_retried_until_one_is_back() {
    let gw = Gateway::start_with(
        MockConfig::default(),
        "[fleet]\nprobe_interval_ms = 100\neject_base_ms = 100\neject_max_ms = 200\n",
    )
    .await;
    gw.mock.set_failure(mock_vllm::FailureMode::Refuse);
    let id = submit(&gw, &body("refused at first", 2)).await;
    // Until a run was refused before reaching the node and the job queued again.
    let since = Instant::now();
    while !parse_metrics(&gw.metrics_text().await).iter().any(|s| {
        s.name == "fleetgate_job_runs_total" && s.labels["outcome"] == "retried" && s.value >= 1.0
    }) {
        assert!(since.elapsed() < WAIT, "no run was retried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gw.mock.set_failure(mock_vllm::FailureMode::None);
    let job = ended(&gw, &id).await;
    assert_eq!(job["status"], "succeeded", "{job}");
    assert!(job["attempts"].as_u64().unwrap() >= 2, "{job}");
    assert_eq!(
        gw.upstream_completions().len(),
        1,
        "only the run that reached the node"
    );
}

#[tokio::test]
async fn a_run_that_may_have_run_fails_with_the_upstream_error_and_is_not_run_again() {
    let gw = Gateway::start().await;
    gw.mock
        .set_failure(mock_vllm::FailureMode::CutStream { after_chunks: 0 });
    let id = submit(&gw, &body("cut short", 4)).await;
    let job = ended(&gw, &id).await;
    assert_eq!(job["status"], "failed", "{job}");
    assert_eq!(job["error"]["error"]["code"], "upstream_error", "{job}");
    assert_eq!(job["attempts"], 1);
    assert_eq!(gw.upstream_completions().len(), 1);
}

/// The key's live usage (`GET /v1/usage` on `url`) once none of its requests runs or
/// holds a reservation any more.
async fn settled_usage(client: &reqwest::Client, url: &str, key: &str) -> Value {
    let since = Instant::now();
    loop {
        let response = client
            .get(format!("{url}/v1/usage"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let usage: Value = response.json().await.unwrap();
        if usage["running"] == 0 && usage["reserved"] == 0 {
            return usage;
        }
        assert!(since.elapsed() < WAIT, "the key never settled: {usage}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Once everything is settled, the key's live counter (`GET /v1/usage` on `url`), the
/// ledger (of `state`'s store) and the usage the succeeded `job` reports are the same.
async fn assert_charged_as_told(
    client: &reqwest::Client,
    url: &str,
    (key_id, key): (i64, &str),
    state: &AppState,
    job: &Value,
) {
    assert_eq!(job["status"], "succeeded", "{job}");
    let told = job["result"]["usage"]["total_tokens"].as_u64().unwrap();
    let usage = settled_usage(client, url, key).await;
    state.ledger().flush().await;
    let ledger = state
        .store()
        .month_usage(key_id, &Month::now().to_string())
        .await
        .unwrap();
    assert_eq!(
        (usage["used"].as_u64().unwrap(), ledger),
        (told, told),
        "(live counter, ledger) against the job's usage; /v1/usage: {usage}"
    );
}

/// A job whose first run stops without ending it while the node generates (its lease
/// lost: another worker took the job over, then queued it again), and whose next run
/// succeeds: the stopped run is charged nothing, in the live counter as in the ledger,
/// and both hold what the job reports.
#[tokio::test]
async fn a_run_that_lost_its_lease_leaves_nothing_in_the_live_counter() {
    // 600 tokens 5 ms apart: a run takes 3 s; a lost lease is seen within 0.5 s.
    let gw = with_jobs(
        MockConfig {
            token_delay: Duration::from_millis(5),
            ..MockConfig::default()
        },
        "lease_ms = 1500\npoll_interval_ms = 50",
    )
    .await;
    let (key_id, key) = gw.create_key(LimitOverrides::default()).await;
    let submitted = submit_as(&gw, &key, &body("Once upon a time", 600), &[]).await;
    assert_eq!(submitted.status(), 202);
    let id = submitted.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    tokio::time::timeout(WAIT, gw.mock.wait_in_flight(1))
        .await
        .unwrap();
    // Another worker takes the job over (as when this one's lease lapsed unrenewed)...
    let jobs = gw.state.store().jobs();
    let lapsed = now_unix_ms() + 60_000;
    let taken = jobs
        .claim("elsewhere", lapsed, 1_500)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((taken.id.as_str(), taken.attempts), (id.as_str(), 2));
    // ...the first run stops mid-generation...
    tokio::time::timeout(WAIT, gw.mock.wait_cancelled(1))
        .await
        .unwrap();
    // ...and the job is queued again, for this gateway's worker to run to its end.
    let now = now_unix_ms();
    assert!(jobs.requeue(&id, 2, now, now).await.unwrap());
    let job = ended_as(&gw, &key, &id).await;
    assert_eq!(job["attempts"], 3, "{job}");
    assert_eq!(gw.upstream_completions().len(), 2);
    assert_charged_as_told(&gw.client, &gw.url, (key_id, &key), &gw.state, &job).await;
}

/// A gateway replica served in this process over `fleet_toml(dir, top_level, …)` in
/// front of `node`: replicas given the same `dir` share its SQLite store.
struct Replica {
    url: String,
    state: AppState,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Replica {
    async fn start(dir: &std::path::Path, top_level: &str, node: &mock_vllm::MockVllm) -> Self {
        let toml = common::fleet_toml(dir, top_level, "", &[(node, "gpu-a", "")]);
        let config = fleetgate::config::Config::from_toml(&toml).unwrap();
        let state = fleetgate::server::prepare(config).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(fleetgate::server::serve(state.clone(), listener, async {
            let _ = stopped.await;
        }));
        Self {
            url,
            state,
            stop,
            served,
        }
    }

    /// Shuts it down as SIGTERM does; returns once it has stopped (its runs cut and
    /// their jobs queued again, its settlements done, its ledger written).
    async fn shut_down(self) -> AppState {
        let _ = self.stop.send(());
        tokio::time::timeout(3 * WAIT, self.served)
            .await
            .expect("the replica stopped")
            .unwrap()
            .unwrap();
        self.state
    }
}

/// This test's keys on the Redis server named by TEST_REDIS_URL (all under `prefix`),
/// deleted when dropped, also when the test fails.
struct RedisKeys {
    connection: redis::Connection,
    prefix: String,
}

impl RedisKeys {
    fn matching(&mut self, pattern: &str) -> Vec<String> {
        redis::cmd("KEYS")
            .arg(format!("{}:{pattern}", self.prefix))
            .query(&mut self.connection)
            .unwrap()
    }
}

impl Drop for RedisKeys {
    fn drop(&mut self) {
        let keys = self.matching("*");
        if !keys.is_empty() {
            let _: Result<i64, _> = redis::cmd("DEL").arg(keys).query(&mut self.connection);
        }
    }
}

/// As [`a_run_that_lost_its_lease_leaves_nothing_in_the_live_counter`], with the live
/// counters in Redis shared by two replicas: the first run is cut by its replica's
/// shutdown, the other replica runs the job again to its end. Nothing stays in the
/// usage journal either, to reach the ledger later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Redis (set TEST_REDIS_URL)"]
async fn a_run_cut_by_a_shutdown_leaves_nothing_in_the_shared_counters() {
    let url = std::env::var("TEST_REDIS_URL").expect("TEST_REDIS_URL, e.g. redis://127.0.0.1:6379");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let prefix = format!("fleetgate-test:jobcut:{}:{nanos}", std::process::id());
    let mut redis_keys = RedisKeys {
        connection: redis::Client::open(url.as_str())
            .unwrap()
            .get_connection()
            .unwrap(),
        prefix: prefix.clone(),
    };
    let node = common::node(MockConfig {
        token_delay: Duration::from_millis(5),
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let top_level = format!(
        "redis_url = \"{url}\"\nredis_key_prefix = \"{prefix}\"\nshutdown_grace_ms = 100\n\
         [jobs]\npoll_interval_ms = 50\n"
    );
    let a = Replica::start(dir.path(), &top_level, &node).await;
    let secret = fleetgate::key_secret::generate();
    let key_id = a
        .state
        .store()
        .create_key("jobcut", None, &secret, &LimitOverrides::default())
        .await
        .unwrap()
        .id;
    let key = secret.secret.expose().to_owned();
    a.state.keys().pull().await.unwrap();
    let client = reqwest::Client::new();
    let submitted = client
        .post(format!("{}/v1/completions", a.url))
        .bearer_auth(&key)
        .header("prefer", "respond-async")
        .header("content-type", "application/json")
        .body(body("Once upon a time", 600))
        .send()
        .await
        .unwrap();
    assert_eq!(submitted.status(), 202);
    let id = submitted.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    tokio::time::timeout(WAIT, node.wait_in_flight(1))
        .await
        .unwrap();
    // The first replica stops while the node generates: past its grace the run is cut
    // and the job queued again.
    let a = a.shut_down().await;
    tokio::time::timeout(WAIT, node.wait_cancelled(1))
        .await
        .unwrap();
    let queued = a.store().jobs().job(key_id, &id).await.unwrap().unwrap();
    assert_eq!((queued.status.as_str(), queued.attempts), ("queued", 1));
    let b = Replica::start(dir.path(), &top_level, &node).await;
    let job = ended_at(&client, &b.url, &key, &id).await;
    assert_eq!(job["attempts"], 2, "{job}");
    assert_charged_as_told(&client, &b.url, (key_id, &key), &b.state, &job).await;
    // The journal forgets each row once the ledger has it: none is left for its sweep
    // (or a replica adopting it) to offer the ledger again, under another id.
    let since = Instant::now();
    loop {
        let journals = redis_keys.matching("unwritten:*");
        if journals.is_empty() {
            break;
        }
        let rows: Vec<Vec<String>> = journals
            .iter()
            .map(|journal| {
                redis::cmd("HKEYS")
                    .arg(journal)
                    .query(&mut redis_keys.connection)
                    .unwrap()
            })
            .collect();
        assert!(
            since.elapsed() < WAIT,
            "rows left in the usage journal (job {id}): {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    b.shut_down().await;
}
