//! What requests nobody is accountable for may cost (issue #33): unauthenticated noise is
//! counted and sampled rather than logged a row at a time, old request-log rows go, and
//! the Workbench's routes count against the key's rate as completions do. (The admin
//! token placeholders are `tests/binary.rs`'s, since `serve` must refuse them; a
//! client's `traceparent` on an unauthenticated request is `tests/traces.rs`'s, since
//! traces need the real binary's global subscriber.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use crate::common::{Gateway, MODEL, expect_error, parse_metrics};
use crate::store::{TestDb, log_row};
use fleetgate::background::request_log_retention;
use fleetgate::store::{LimitOverrides, RequestQuery, Store, now_unix_ms};

/// Unauthenticated requests sent by the flood test.
const NOISE: usize = 300;
/// Requests with the key sent among them.
const SERVED: usize = 20;

#[tokio::test]
async fn unauthenticated_noise_is_counted_and_sampled_and_served_rows_all_stay() {
    let gw = Gateway::start().await;
    let started = Instant::now();
    let noise = (0..NOISE).map(|i| {
        let request = gw.client.get(format!("{}/v1/models", gw.url));
        // Missing, malformed and well-formed-looking but wrong keys.
        let request = match i % 3 {
            0 => request,
            1 => request.header("authorization", "Basic dXNlcjpwYXNz"),
            _ => request.bearer_auth("sk-not-a-key"),
        };
        async move { request.send().await.unwrap().status().as_u16() }
    });
    let served =
        (0..SERVED).map(|_| async { gw.get("/v1/models").send().await.unwrap().status().as_u16() });
    let (noise, served) = tokio::join!(join_all(noise), join_all(served));
    let elapsed = started.elapsed();
    assert!(noise.iter().all(|&s| s == 401), "{noise:?}");
    assert!(served.iter().all(|&s| s == 200), "{served:?}");

    gw.state.request_log().flush().await;
    let rows = gw
        .state
        .store()
        .requests(&RequestQuery {
            limit: 10_000,
            ..RequestQuery::default()
        })
        .await
        .unwrap();
    let served_rows = rows.iter().filter(|r| r.status == 200).count();
    assert_eq!(served_rows, SERVED, "every served request keeps its row");
    // A sample of the noise: at most one row a second (and the first one at once).
    let noise_rows = rows.iter().filter(|r| r.status == 401).count();
    let bound = usize::try_from(elapsed.as_secs()).unwrap() + 1;
    assert!(
        (1..=bound).contains(&noise_rows),
        "{noise_rows} rows for {NOISE} unauthenticated requests in {elapsed:?}"
    );

    let counted: f64 = parse_metrics(&gw.metrics_text().await)
        .iter()
        .filter(|s| {
            s.name == "fleetgate_unauthenticated_refusals_total"
                && s.labels.get("code").map(String::as_str) == Some("invalid_api_key")
        })
        .map(|s| s.value)
        .sum();
    assert_eq!(counted, NOISE as f64, "each one is counted");
}

/// Rows older than `retention_days` are deleted, in batches, on both backends; newer
/// ones stay.
async fn request_log_rows_past_retention_are_swept(store: Arc<dyn Store>) {
    const DAY_MS: i64 = 24 * 3600 * 1000;
    let now = now_unix_ms();
    // More than one batch of old rows, a day past 90 days; one just inside.
    let mut rows: Vec<_> = (0..2_500)
        .map(|i| log_row(&format!("old-{i}"), now - 91 * DAY_MS - i))
        .collect();
    rows.push(log_row("recent", now - 89 * DAY_MS));
    rows.push(log_row("today", now));
    store.append_request_log(&rows).await.unwrap();

    let deleted = request_log_retention::sweep(store.as_ref(), 90, now)
        .await
        .unwrap();
    assert_eq!(deleted, 2_500);
    let left = store.recent_requests(10_000).await.unwrap();
    let mut ids: Vec<_> = left.iter().map(|r| r.request_id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["recent", "today"]);
    // 0: kept forever.
    let kept = request_log_retention::sweep(store.as_ref(), 0, now + 1_000 * DAY_MS)
        .await
        .unwrap();
    assert_eq!(kept, 0);
}

backend_tests! {
    store: [request_log_rows_past_retention_are_swept],
    url: [],
}

#[tokio::test]
async fn workbench_routes_count_against_the_keys_rate() {
    let gw = Gateway::start().await;
    let (_, key) = gw
        .create_key(LimitOverrides {
            requests_per_minute: Some(3),
            ..LimitOverrides::default()
        })
        .await;
    let list = || {
        gw.client
            .get(format!("{}/v1/workbench/items", gw.url))
            .bearer_auth(&key)
            .timeout(Duration::from_secs(10))
    };
    let completion = serde_json::json!({"model": MODEL, "prompt": "hi", "max_tokens": 1});
    let completed = gw.complete_as(&key, &completion.to_string()).send().await;
    assert_eq!(completed.unwrap().status(), 200);
    for _ in 0..2 {
        assert_eq!(list().send().await.unwrap().status(), 200);
    }
    let refused = list().send().await.unwrap();
    assert!(refused.headers().contains_key("retry-after"), "{refused:?}");
    expect_error(refused, 429, "rate_limited").await;
    // One rate for both: the Workbench's requests used up the completions' too.
    let completed = gw.complete_as(&key, &completion.to_string()).send().await;
    expect_error(completed.unwrap(), 429, "rate_limited").await;
}
