//! Completion jobs through a real server: submit (`Prefer: respond-async`) and harvest
//! (`GET /v1/harvest/{id}?wait=`), for the suites that run the binaries.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The model every test config serves.
const MODEL: &str = "llama-8b";

/// Submits a job of `max_tokens` for `prompt`; returns its id.
pub async fn submit(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    prompt: &str,
    max_tokens: u32,
) -> String {
    let response = client
        .post(format!("{url}/v1/completions"))
        .bearer_auth(key)
        .header("prefer", "respond-async")
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        202,
        "{}",
        response.text().await.unwrap_or_default()
    );
    let job: Value = response.json().await.unwrap();
    job["id"].as_str().unwrap().to_owned()
}

/// Long-polls job `id` on `url` until it has ended (within `limit`); returns it.
pub async fn harvest(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    id: &str,
    limit: Duration,
) -> Value {
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
        assert!(
            since.elapsed() < limit,
            "job {id} did not end within {limit:?}: {job}"
        );
    }
}
