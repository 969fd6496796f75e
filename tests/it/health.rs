//! `GET /health`: per-model readiness and, with `verbose`, each node's state and why it
//! is down; `GET /ready` and `GET /live` for load balancers and orchestrators.

use std::time::Duration;

use crate::common::{self, CHECKPOINT, Gateway, MODEL, expect_error};
use mock_vllm::{FailureMode, MockConfig, MockVllm};
use serde_json::{Value, json};

async fn node() -> MockVllm {
    common::node(MockConfig::default()).await
}

/// A gateway over two nodes (`gpu-a`, `gpu-b`), probing every 50 ms.
async fn two_nodes() -> (Gateway, MockVllm, MockVllm) {
    let (a, b) = (node().await, node().await);
    let fleet = "[fleet]
probe_interval_ms = 50
probe_timeout_ms = 500
eject_base_ms = 100";
    let gw = Gateway::start_fleet(fleet, "", &[(&a, "gpu-a", ""), (&b, "gpu-b", "")]).await;
    (gw, a, b)
}

async fn health(gw: &Gateway, query: &str) -> (u16, Value) {
    let response = gw
        .client
        .get(format!("{}/health{query}", gw.url))
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

/// Polls `/health?verbose` until the model has `up` nodes up (bounded).
async fn wait_nodes_up(gw: &Gateway, up: u64) -> Value {
    let polled = async {
        loop {
            let (_, body) = health(gw, "?verbose=true").await;
            if body["models"][0]["nodes_up"] == up {
                return body;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), polled)
        .await
        .unwrap_or_else(|_| panic!("the model never had {up} nodes up"))
}

#[tokio::test]
async fn health_reports_each_model_and_verbose_each_node() {
    let (gw, a, b) = two_nodes().await;
    let (status, body) = health(&gw, "").await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"status": "ok", "store": true, "admission": true, "models": [
            {"id": MODEL, "ready": true, "asleep": false, "nodes_up": 2, "nodes": 2, "queued": 0}
        ]})
    );

    a.set_failure(FailureMode::Refuse);
    let body = wait_nodes_up(&gw, 1).await;
    assert_eq!(body["status"], "ok", "one node up is enough to be ready");
    assert_eq!(
        body["models"][0]["upstreams"],
        json!([{"gpu": "gpu-a", "up": false, "down_reason": "probe_failed", "in_flight": 0}, {"gpu": "gpu-b", "up": true, "in_flight": 0}])
    );

    b.set_failure(FailureMode::Refuse);
    let body = wait_nodes_up(&gw, 0).await;
    assert_eq!(body["models"][0]["ready"], false);
    assert_eq!(body["status"], "degraded");
    let (status, _) = health(&gw, "").await;
    assert_eq!(
        status, 200,
        "a model without nodes does not fail the gateway's own health"
    );

    // Restarted nodes are re-admitted by the probes.
    a.set_failure(FailureMode::None);
    b.set_failure(FailureMode::None);
    let body = wait_nodes_up(&gw, 2).await;
    assert_eq!(body["status"], "ok");
}

#[tokio::test]
async fn health_rejects_a_malformed_verbose_flag() {
    let gw = Gateway::start().await;
    let response = gw
        .client
        .get(format!("{}/health?verbose=yes", gw.url))
        .send()
        .await
        .unwrap();
    expect_error(response, 400, "invalid_request").await;
}

#[tokio::test]
async fn a_node_serving_another_checkpoint_is_ejected_without_taking_the_others_along() {
    let a = node().await;
    let other = MockVllm::start(MockConfig {
        served_model_name: "someone/else-7B".to_owned(),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    // Down at start, so the gateway first learns of it from a probe.
    other.set_failure(FailureMode::Refuse);
    let fleet = "[fleet]
probe_interval_ms = 50
probe_timeout_ms = 500
eject_base_ms = 50
eject_max_ms = 50";
    let gw = Gateway::start_fleet(fleet, "", &[(&a, "gpu-a", ""), (&other, "gpu-other", "")]).await;
    wait_nodes_up(&gw, 1).await;
    other.set_failure(FailureMode::None);
    // A bounded negative check over ten probe intervals (the other node is probed
    // every one or two of them): it stays out, and the right node never leaves.
    for _ in 0..10 {
        let (_, body) = health(&gw, "?verbose=true").await;
        assert_eq!(
            body["models"][0]["upstreams"],
            json!([{"gpu": "gpu-a", "up": true, "in_flight": 0}, {"gpu": "gpu-other", "up": false, "down_reason": "probe_failed", "in_flight": 0}]),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let response = gw
        .complete(&json!({"prompt": [1, 2], "max_tokens": 2}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.headers()["x-acs-upstream-model"], CHECKPOINT);
}

async fn get(client: &reqwest::Client, url: &str) -> (u16, Value) {
    let response = client.get(url).send().await.unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

#[tokio::test]
async fn a_serving_gateway_is_live_and_ready() {
    let gw = Gateway::start().await;
    let live = get(&gw.client, &format!("{}/live", gw.url)).await;
    assert_eq!(live, (200, json!({"status": "ok"})));
    let ready = get(&gw.client, &format!("{}/ready", gw.url)).await;
    assert_eq!(ready, (200, json!({"ready": true, "reasons": []})));
}

/// A node whose request failed says so in verbose health (the probe is slow here, so
/// the request's failure is what took it down).
#[tokio::test]
async fn verbose_health_says_a_failed_request_took_the_node_down() {
    let (a, b) = (node().await, node().await);
    let fleet = "[fleet]
probe_interval_ms = 60000
eject_base_ms = 60000
eject_max_ms = 60000";
    let gw = Gateway::start_fleet(fleet, "", &[(&a, "gpu-a", ""), (&b, "gpu-b", "")]).await;
    a.set_failure(FailureMode::Status500);
    b.set_failure(FailureMode::Status500);
    let body = json!({"prompt": [1, 2], "max_tokens": 2}).to_string();
    for _ in 0..2 {
        gw.complete(&body)
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
    }
    let (_, health) = health(&gw, "?verbose=true").await;
    let reasons: Vec<&Value> = health["models"][0]["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|node| &node["down_reason"])
        .collect();
    assert!(reasons.contains(&&json!("request_failed")), "{health}");
}

/// The live counters (Redis) cannot be reached: every request would get 503
/// `admission_unavailable`, so the replica is not ready and health says why — while it
/// stays live (a restart would not bring Redis back).
#[tokio::test]
async fn an_unreachable_redis_makes_the_replica_unready_but_live() {
    let mock = node().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let toml = common::fleet_toml(
        dir.path(),
        &format!("redis_url = \"redis://127.0.0.1:{closed}\""),
        "",
        &[(&mock, "gpu-a", "")],
    );
    let config = fleetgate::config::Config::from_toml(&toml).unwrap();
    let state = fleetgate::server::prepare(config).await.unwrap();
    let key = fleetgate::key_secret::generate();
    state
        .store()
        .create_key(
            "t",
            None,
            &key,
            &fleetgate::store::LimitOverrides::default(),
        )
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(fleetgate::server::serve(state, listener, async {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::new();

    let ready = get(&client, &format!("{url}/ready")).await;
    assert_eq!(
        ready,
        (
            503,
            json!({"ready": false, "reasons": ["admission_unavailable"]})
        )
    );
    let live = get(&client, &format!("{url}/live")).await;
    assert_eq!(live.0, 200);
    let (status, health) = get(&client, &format!("{url}/health")).await;
    assert_eq!(status, 200, "the store answers: {health}");
    assert_eq!(health["admission"], false);
    assert_eq!(health["status"], "degraded");

    let refused = client
        .post(format!("{url}/v1/completions"))
        .bearer_auth(key.secret.expose())
        .json(&json!({"prompt": "Hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert!(
        !refused.headers().contains_key("x-acs-upstream-gpu"),
        "nothing went upstream: {:?}",
        refused.headers()
    );
    expect_error(refused, 503, "admission_unavailable").await;

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}
