//! Live fleet changes: `POST /admin/reload` re-reads the config file; nodes come and go
//! without a restart, requests already on a node finish there, and a bad file changes
//! nothing. (SIGHUP, the same reload, is driven on the real binary in `tests/binary.rs`.)

use std::time::Duration;

use crate::common::{self, Gateway, MODEL, expect_error, parse_metrics};
use mock_vllm::{MockConfig, MockVllm};
use serde_json::{Value, json};

const TOKEN: &str = "admin-token-for-reload-tests-0123";

fn top_level() -> String {
    format!("admin_token = \"{TOKEN}\"")
}

async fn node() -> MockVllm {
    common::node(MockConfig::default()).await
}

async fn reload(gw: &Gateway) -> reqwest::Response {
    gw.client
        .post(format!("{}/admin/reload", gw.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
}

/// A completion of `body`, bounded: a request stuck on a held node fails the test.
async fn complete(gw: &Gateway, body: &Value) -> reqwest::Response {
    tokio::time::timeout(
        Duration::from_secs(10),
        gw.complete(&body.to_string()).send(),
    )
    .await
    .expect("answered within 10 s")
    .unwrap()
}

fn short() -> Value {
    json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3})
}

fn gpu(response: &reqwest::Response) -> String {
    response.headers()["x-acs-upstream-gpu"]
        .to_str()
        .unwrap()
        .to_owned()
}

fn completions(mock: &MockVllm) -> usize {
    mock.received()
        .iter()
        .filter(|r| r.path == "/v1/completions")
        .count()
}

/// A streaming request held on `mock` (its gate closed) until the gate opens: the task
/// answers its status, the GPU that served it and its whole body.
async fn hold_on(gw: &Gateway, mock: &MockVllm) -> tokio::task::JoinHandle<(u16, String, String)> {
    mock.close_gate();
    let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "stream": true});
    let request = gw.complete(&body.to_string());
    let held = tokio::spawn(async move {
        let response = request.send().await.unwrap();
        let (status, gpu) = (response.status().as_u16(), gpu(&response));
        (status, gpu, response.text().await.unwrap())
    });
    tokio::time::timeout(Duration::from_secs(10), mock.wait_in_flight(1))
        .await
        .expect("the request reached the node");
    held
}

async fn nodes_in_health(gw: &Gateway) -> u64 {
    gw.get_json("/health").await["models"][0]["nodes"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn a_node_added_by_a_reload_takes_traffic_without_a_restart() {
    let (a, b) = (node().await, node().await);
    let gw = Gateway::start_fleet_from_file(&top_level(), "", &[(&a, "gpu-a", "")]).await;
    let held = hold_on(&gw, &a).await;
    gw.rewrite_config(&top_level(), "", &[(&a, "gpu-a", ""), (&b, "gpu-b", "")]);

    let response = reload(&gw).await;
    assert_eq!(response.status(), 200);
    let report: Value = response.json().await.unwrap();
    assert_eq!(
        report,
        json!({
            "models": [{
                "model": MODEL,
                "added": [{"url": b.url(), "gpu": "gpu-b"}],
                "removed": [],
                "changed": [],
            }],
            "restart_required": [],
        })
    );

    // With a request held on gpu-a, the next goes to the lighter node: the new one.
    let response = complete(&gw, &short()).await;
    assert_eq!(response.status(), 200);
    assert_eq!(gpu(&response), "gpu-b");
    assert_eq!(completions(&b), 1);
    a.open_gate();
    assert_eq!(held.await.unwrap().0, 200);

    assert_eq!(nodes_in_health(&gw).await, 2);
    let metrics = parse_metrics(&gw.metrics_text().await);
    let up = metrics
        .iter()
        .find(|s| s.name == "fleetgate_upstream_up" && s.labels["gpu"] == "gpu-b")
        .expect("the new node has its series");
    assert_eq!(up.value, 1.0);
}

#[tokio::test]
async fn a_node_removed_while_a_request_is_on_it_finishes_that_request() {
    let (a, b) = (node().await, node().await);
    let gw = Gateway::start_fleet_from_file(&top_level(), "", &[(&a, "gpu-a", "")]).await;
    let held = hold_on(&gw, &a).await;

    gw.rewrite_config(&top_level(), "", &[(&b, "gpu-b", "")]);
    let response = reload(&gw).await;
    assert_eq!(response.status(), 200);
    let report: Value = response.json().await.unwrap();
    assert_eq!(
        report["models"][0]["removed"],
        json!([{"url": a.url(), "gpu": "gpu-a"}])
    );
    assert_eq!(report["models"][0]["added"][0]["gpu"], "gpu-b");

    // New requests go to the node that is left, while the held one is still on gpu-a.
    let response = complete(&gw, &short()).await;
    assert_eq!(gpu(&response), "gpu-b");
    assert_eq!(a.in_flight(), 1);
    a.open_gate();
    let (status, served_by, body) = held.await.unwrap();
    assert_eq!((status, served_by.as_str()), (200, "gpu-a"));
    assert!(
        body.trim_end().ends_with("data: [DONE]"),
        "whole stream: {body}"
    );
    assert_eq!(completions(&a), 1, "nothing new reached the removed node");
    assert_eq!(nodes_in_health(&gw).await, 1);
    let metrics = gw.metrics_text().await;
    assert!(
        !metrics.contains("fleetgate_upstream_up{model=\"llama-8b\",gpu=\"gpu-a\"}"),
        "the removed node's gauges are gone:\n{metrics}"
    );
}

/// The gateway keeps each node's series once found; a node removed and added back
/// must count on the gauge `/metrics` exports, not on the one its removal dropped.
#[tokio::test]
async fn a_node_added_back_counts_its_requests_in_flight_again() {
    let (a, b) = (node().await, node().await);
    let gw = Gateway::start_fleet_from_file(&top_level(), "", &[(&a, "gpu-a", "")]).await;
    assert_eq!(complete(&gw, &short()).await.status(), 200);
    for fleet in [[(&b, "gpu-b", "")], [(&a, "gpu-a", "")]] {
        gw.rewrite_config(&top_level(), "", &fleet);
        assert_eq!(reload(&gw).await.status(), 200);
    }

    let held = hold_on(&gw, &a).await;
    let in_flight = parse_metrics(&gw.metrics_text().await)
        .into_iter()
        .find(|s| s.name == "fleetgate_in_flight_requests" && s.labels["gpu"] == "gpu-a")
        .expect("the node added back has its gauge")
        .value;
    assert_eq!(in_flight, 1.0);
    a.open_gate();
    assert_eq!(held.await.unwrap().0, 200);
}

#[tokio::test]
async fn an_invalid_config_is_refused_and_changes_nothing() {
    let (a, b) = (node().await, node().await);
    let gw = Gateway::start_fleet_from_file(&top_level(), "", &[(&a, "gpu-a", "")]).await;
    gw.rewrite_config(
        &top_level(),
        "",
        &[(&a, "gpu-a", ""), (&b, "gpu-b", "weight = 0")],
    );
    let body = expect_error(reload(&gw).await, 422, "invalid_config").await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("models.upstreams.weight of 'llama-8b' must be at least 1")
            && message.contains("nothing was changed"),
        "{message}"
    );
    std::fs::write(gw.config_file(), "[[models]\nid = ").unwrap();
    let body = expect_error(reload(&gw).await, 422, "invalid_config").await;
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("fleetgate.toml"),
        "{body}"
    );

    for _ in 0..4 {
        let response = complete(&gw, &short()).await;
        assert_eq!(gpu(&response), "gpu-a");
    }
    assert_eq!(completions(&b), 0);
    assert_eq!(nodes_in_health(&gw).await, 1);
}

#[tokio::test]
async fn a_reweighted_node_keeps_its_requests_and_other_changes_wait_for_a_restart() {
    let (a, b) = (node().await, node().await);
    let gw = Gateway::start_fleet_from_file(&top_level(), "", &[(&a, "gpu-a", "")]).await;
    let held = hold_on(&gw, &a).await;
    let changed = format!("{}\nmax_body_bytes = 10", top_level());
    gw.rewrite_config(
        &changed,
        "",
        &[
            (&a, "gpu-a", "weight = 3\nmax_in_flight = 8"),
            (&b, "gpu-b", ""),
        ],
    );
    let response = reload(&gw).await;
    assert_eq!(response.status(), 200);
    let report: Value = response.json().await.unwrap();
    assert_eq!(
        report["models"][0]["changed"],
        json!([{
            "url": a.url(), "gpu": "gpu-a",
            "weight_before": 1, "weight": 3,
            "max_in_flight_before": null, "max_in_flight": 8,
        }])
    );
    assert_eq!(report["restart_required"], json!(["max_body_bytes"]));

    // Not applied: a body over 10 bytes still goes through (to gpu-b: gpu-a, with its
    // request still counted, is the busier one even at weight 3).
    let response = complete(&gw, &short()).await;
    assert_eq!(
        (response.status().as_u16(), gpu(&response).as_str()),
        (200, "gpu-b")
    );
    // The held request is still counted on gpu-a.
    let health = gw.get_json("/health?verbose=true").await;
    let on_a = &health["models"][0]["upstreams"][0];
    assert_eq!(
        (&on_a["gpu"], &on_a["in_flight"]),
        (&json!("gpu-a"), &json!(1))
    );
    a.open_gate();
    assert_eq!(held.await.unwrap().0, 200);
}
