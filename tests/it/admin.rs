//! The admin API: guarded by the admin token, off without one.

use crate::common::{Gateway, MODEL, expect_error};
use mock_vllm::MockConfig;
use serde_json::{Value, json};

const TOKEN: &str = "admin-token-for-tests-0123456789";

async fn admin() -> Gateway {
    Gateway::start_with(MockConfig::default(), &format!("admin_token = \"{TOKEN}\"")).await
}

async fn call(
    gw: &Gateway,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> reqwest::Response {
    let mut request = gw
        .client
        .request(method, format!("{}{path}", gw.url))
        .bearer_auth(TOKEN);
    if let Some(body) = body {
        request = request.json(&body);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn keys_are_created_limited_inspected_and_revoked() {
    let gw = admin().await;
    let created = call(
        &gw,
        reqwest::Method::POST,
        "/admin/keys",
        Some(json!({"name": "eval-team", "email": "eval@example.org", "monthly_budget": 50})),
    )
    .await;
    assert_eq!(created.status(), 201);
    let created: Value = created.json().await.unwrap();
    let secret = created["secret"].as_str().unwrap().to_owned();
    let prefix = created["prefix"].as_str().unwrap().to_owned();
    assert!(secret.starts_with(&prefix));
    assert_eq!(created["limits"]["monthly_budget"], 50);
    assert_eq!(
        created["limits"]["max_concurrent"], 16,
        "defaults fill the rest"
    );
    assert_eq!(created["overrides"]["max_concurrent"], Value::Null);

    // The new key works, within its budget.
    let body = json!({"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 100}).to_string();
    let response = gw.complete_as(&secret, &body).send().await.unwrap();
    assert_eq!(
        response.headers()["x-acs-max-tokens-clamped"],
        "requested=100,applied=45,reason=budget,source=client"
    );
    response.bytes().await.unwrap();

    let patched = call(
        &gw,
        reqwest::Method::PATCH,
        &format!("/admin/keys/{prefix}/limits"),
        Some(json!({"monthly_budget": null, "max_queued": 3})),
    )
    .await;
    let patched: Value = patched.json().await.unwrap();
    assert_eq!(
        patched["limits"]["monthly_budget"], 10_000_000,
        "null returns to the default"
    );
    assert_eq!(patched["overrides"]["max_queued"], 3);

    let id = created["id"].as_i64().unwrap();
    gw.wait_occupancy(id, 0, 0).await;
    let usage: Value = call(
        &gw,
        reqwest::Method::GET,
        &format!("/admin/keys/{id}/usage"),
        None,
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(usage["used"], 50);
    assert_eq!(usage["max_queued"], 3);

    let listed: Value = call(&gw, reqwest::Method::GET, "/admin/keys", None)
        .await
        .json()
        .await
        .unwrap();
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["prefix"] == prefix.as_str())
    );
    assert!(
        !listed.to_string().contains(&secret),
        "secrets are never listed"
    );

    let revoked = call(
        &gw,
        reqwest::Method::POST,
        &format!("/admin/keys/{prefix}/revoke"),
        None,
    )
    .await;
    assert_eq!(revoked.json::<Value>().await.unwrap()["active"], false);
    let after = gw.complete_as(&secret, &body).send().await.unwrap();
    expect_error(after, 401, "invalid_api_key").await;
}

#[tokio::test]
async fn the_admin_api_needs_its_token_and_rejects_bad_input() {
    let gw = admin().await;
    let anonymous = gw
        .client
        .get(format!("{}/admin/keys", gw.url))
        .send()
        .await
        .unwrap();
    expect_error(anonymous, 401, "invalid_api_key").await;
    let with_a_client_key = gw.get("/admin/keys").send().await.unwrap();
    expect_error(with_a_client_key, 401, "invalid_api_key").await;
    let unknown = call(
        &gw,
        reqwest::Method::GET,
        "/admin/keys/fg-nosuchkey/usage",
        None,
    )
    .await;
    expect_error(unknown, 404, "key_not_found").await;
    let extra = call(
        &gw,
        reqwest::Method::POST,
        "/admin/keys",
        Some(json!({"name": "x", "budget": 5})),
    )
    .await;
    expect_error(extra, 400, "invalid_request").await;
    let zero = call(
        &gw,
        reqwest::Method::PATCH,
        "/admin/keys/1/limits",
        Some(json!({"max_concurrent": 0})),
    )
    .await;
    expect_error(zero, 400, "invalid_request").await;
}

#[tokio::test]
async fn without_an_admin_token_the_admin_api_does_not_exist() {
    let gw = Gateway::start().await;
    let response = gw
        .client
        .get(format!("{}/admin/keys", gw.url))
        .bearer_auth("anything")
        .send()
        .await
        .unwrap();
    expect_error(response, 404, "not_found").await;
}
