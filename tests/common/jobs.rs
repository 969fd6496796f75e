//! Completion jobs through a real server: submit (`Prefer: respond-async`) and harvest
//! (`GET /v1/harvest/{id}?wait=`), for the suites that run the binaries.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The model every test config serves.
const MODEL: &str = "llama-8b";

/// Submits a job of `max_tokens` for `prompt`; returns its id. A 503 (the shared
/// counters or the store did not answer in time on a loaded machine: nothing was
/// stored) is retried after its `Retry-After`, as a client would, a few times.
pub async fn submit(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    prompt: &str,
    max_tokens: u32,
) -> String {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens});
    for _ in 0..5 {
        let response = client
            .post(format!("{url}/v1/completions"))
            .bearer_auth(key)
            .header("prefer", "respond-async")
            .json(&body)
            .send()
            .await
            .unwrap();
        if response.status() == 503 {
            let wait: u64 = response.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            tokio::time::sleep(Duration::from_secs(wait)).await;
            continue;
        }
        assert_eq!(
            response.status(),
            202,
            "{}",
            response.text().await.unwrap_or_default()
        );
        let job: Value = response.json().await.unwrap();
        return job["id"].as_str().unwrap().to_owned();
    }
    panic!("{prompt}: still 503 after 5 tries");
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
