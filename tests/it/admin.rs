//! The admin API: guarded by the admin token, off without one.

use crate::common::{Gateway, MODEL, expect_error};
use mock_vllm::MockConfig;
use serde_json::{Value, json};

pub(crate) const TOKEN: &str = "admin-token-for-tests-0123456789";

/// A gateway with the admin API on (also for the rotation suite).
pub(crate) async fn admin() -> Gateway {
    Gateway::start_with(MockConfig::default(), &format!("admin_token = \"{TOKEN}\"")).await
}

/// An admin call with the admin token and a JSON body (or none).
pub(crate) async fn call(
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
    assert_eq!(created["limits"]["share"], 1, "the default share");
    assert_eq!(created["overrides"]["share"], Value::Null);

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
        Some(json!({"monthly_budget": null, "max_queued": 3, "share": 4})),
    )
    .await;
    let patched: Value = patched.json().await.unwrap();
    assert_eq!(
        patched["limits"]["monthly_budget"], 10_000_000,
        "null returns to the default"
    );
    assert_eq!(patched["overrides"]["max_queued"], 3);
    assert_eq!(
        (&patched["limits"]["share"], &patched["overrides"]["share"]),
        (&json!(4), &json!(4))
    );
    let shown = call(
        &gw,
        reqwest::Method::GET,
        &format!("/admin/keys/{prefix}"),
        None,
    )
    .await;
    assert_eq!(shown.json::<Value>().await.unwrap()["limits"]["share"], 4);

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
    assert_eq!(usage["share"], 4);
    // The key sees its own share too.
    let own: Value = gw
        .client
        .get(format!("{}/v1/usage", gw.url))
        .bearer_auth(&secret)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!((&own["share"], &own["max_queued"]), (&json!(4), &json!(3)));

    // null returns the share to the default.
    let reset: Value = call(
        &gw,
        reqwest::Method::PATCH,
        &format!("/admin/keys/{prefix}/limits"),
        Some(json!({"share": null})),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(
        (&reset["limits"]["share"], &reset["overrides"]["share"]),
        (&json!(1), &Value::Null)
    );
    assert_eq!(reset["overrides"]["max_queued"], 3, "the others are kept");

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

/// `(field, smallest, largest)`: the bounds the store's columns hold.
const BOUNDS: [(&str, i64, i64); 5] = [
    ("monthly_budget", 0, i64::MAX),
    ("requests_per_minute", 1, i32::MAX as i64),
    ("max_concurrent", 1, i32::MAX as i64),
    ("max_queued", 0, i32::MAX as i64),
    ("share", 1, 1000),
];

/// Every bad value of `field` with the message it must get: one below the smallest, one
/// above the largest (and, for the `u32` limits, values that fit a `u32` and that do
/// not), and values of the wrong type.
fn bad_values(field: &str, min: i64, max: i64) -> Vec<(Value, String)> {
    let range = |got: &str| format!("{field} must be between {min} and {max} (got {got})");
    let whole =
        |got: &str| format!("{field} must be a whole number between {min} and {max} (got {got})");
    let mut cases = vec![
        (json!(min - 1), range(&(min - 1).to_string())),
        (json!(max as u64 + 1), range(&(max as u64 + 1).to_string())),
        (json!(u64::MAX), range(&u64::MAX.to_string())),
        (json!(i64::MIN), range(&i64::MIN.to_string())),
        (json!("5"), whole("\"5\"")),
        (json!(1.5), whole("1.5")),
        (json!(5.0), whole("5.0")),
        (json!(true), whole("true")),
        (json!([1]), whole("[1]")),
        (json!({"value": 1}), whole("{\"value\":1}")),
    ];
    if max == i64::from(i32::MAX) {
        cases.push((json!(3_000_000_000_u64), range("3000000000")));
        cases.push((json!(5_000_000_000_u64), range("5000000000")));
    }
    cases
}

async fn get_json(gw: &Gateway, path: &str) -> Value {
    let response = call(gw, reqwest::Method::GET, path, None).await;
    assert_eq!(response.status(), 200, "GET {path}");
    response.json().await.unwrap()
}

async fn expect_invalid_limit(response: reqwest::Response, field: &str, message: &str) {
    let body = expect_error(response, 400, "invalid_request").await;
    assert_eq!(body["error"]["param"], field, "{body}");
    assert_eq!(body["error"]["message"], message, "{body}");
}

#[tokio::test]
async fn every_bad_limit_value_is_400_naming_the_field_on_create_and_patch() {
    let gw = admin().await;
    let created = call(
        &gw,
        reqwest::Method::POST,
        "/admin/keys",
        Some(json!({"name": "target", "max_queued": 7})),
    )
    .await;
    assert_eq!(created.status(), 201);
    let created: Value = created.json().await.unwrap();
    let prefix = created["prefix"].as_str().unwrap().to_owned();
    let shown = format!("/admin/keys/{prefix}");
    let before = get_json(&gw, &shown).await;
    let all_before = get_json(&gw, "/admin/keys").await;

    let mut checked = 0;
    for (field, min, max) in BOUNDS {
        for (value, message) in bad_values(field, min, max) {
            let create = call(
                &gw,
                reqwest::Method::POST,
                "/admin/keys",
                Some(json!({"name": "bad", field: value.clone()})),
            )
            .await;
            expect_invalid_limit(create, field, &message).await;
            // Checked before the key is looked up: unknown keys get the same answer.
            for target in [prefix.as_str(), "fg-nosuchkey", "404"] {
                let patch = call(
                    &gw,
                    reqwest::Method::PATCH,
                    &format!("/admin/keys/{target}/limits"),
                    Some(json!({field: value.clone()})),
                )
                .await;
                expect_invalid_limit(patch, field, &message).await;
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 5 * 10 + 3 * 2);
    assert_eq!(get_json(&gw, &shown).await, before, "nothing changed");
    assert_eq!(
        get_json(&gw, "/admin/keys").await,
        all_before,
        "nothing created"
    );
}

/// Found by trying it: this answered 500 (the store refused the value) while the OpenAPI
/// document promised 400.
#[tokio::test]
async fn patching_max_queued_to_3000000000_is_400_not_500() {
    let gw = admin().await;
    let response = call(
        &gw,
        reqwest::Method::PATCH,
        "/admin/keys/1/limits",
        Some(json!({"max_queued": 3_000_000_000_u64})),
    )
    .await;
    expect_invalid_limit(
        response,
        "max_queued",
        "max_queued must be between 0 and 2147483647 (got 3000000000)",
    )
    .await;
}

#[tokio::test]
async fn a_share_of_0_or_over_1000_is_400_naming_share() {
    let gw = admin().await;
    for (share, got) in [(json!(0), "0"), (json!(1001), "1001")] {
        let message = format!("share must be between 1 and 1000 (got {got})");
        let create = call(
            &gw,
            reqwest::Method::POST,
            "/admin/keys",
            Some(json!({"name": "weighty", "share": share.clone()})),
        )
        .await;
        expect_invalid_limit(create, "share", &message).await;
        let patch = call(
            &gw,
            reqwest::Method::PATCH,
            "/admin/keys/1/limits",
            Some(json!({"share": share})),
        )
        .await;
        expect_invalid_limit(patch, "share", &message).await;
    }
}

#[tokio::test]
async fn the_edges_of_every_limit_are_accepted() {
    let gw = admin().await;
    let smallest: serde_json::Map<String, Value> = BOUNDS
        .iter()
        .map(|(field, min, _)| ((*field).to_owned(), json!(min)))
        .collect();
    let largest: serde_json::Map<String, Value> = BOUNDS
        .iter()
        .map(|(field, _, max)| ((*field).to_owned(), json!(max)))
        .collect();
    let mut body = smallest.clone();
    body.insert("name".to_owned(), json!("edges"));
    let created = call(&gw, reqwest::Method::POST, "/admin/keys", Some(body.into())).await;
    assert_eq!(created.status(), 201);
    let created: Value = created.json().await.unwrap();
    assert_eq!(created["overrides"], Value::Object(smallest));
    let patched = call(
        &gw,
        reqwest::Method::PATCH,
        &format!("/admin/keys/{}/limits", created["id"]),
        Some(largest.clone().into()),
    )
    .await;
    assert_eq!(patched.status(), 200);
    let patched: Value = patched.json().await.unwrap();
    assert_eq!(patched["overrides"], Value::Object(largest.clone()));
    assert_eq!(patched["limits"], Value::Object(largest));
}

#[tokio::test]
async fn unknown_keys_are_404_on_every_route() {
    let gw = admin().await;
    for target in ["fg-nosuchkey", "12345", "99999999999999999999999"] {
        for (method, path, body) in [
            (reqwest::Method::GET, format!("/admin/keys/{target}"), None),
            (
                reqwest::Method::POST,
                format!("/admin/keys/{target}/revoke"),
                None,
            ),
            (
                reqwest::Method::POST,
                format!("/admin/keys/{target}/rotate"),
                None,
            ),
            (
                reqwest::Method::PATCH,
                format!("/admin/keys/{target}/limits"),
                Some(json!({"max_queued": 3})),
            ),
            (
                reqwest::Method::GET,
                format!("/admin/keys/{target}/usage"),
                None,
            ),
        ] {
            let response = call(&gw, method.clone(), &path, body).await;
            let body = expect_error(response, 404, "key_not_found").await;
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("'{target}'")),
                "{method} {path}: {body}"
            );
        }
    }
}

/// A NUL character in a key's name or e-mail is 400 naming the field, and in the `{key}`
/// of a route it names no key (404): never a store error (500 on PostgreSQL, whose
/// `TEXT` cannot hold it; found by the schema-driven fuzz run).
#[tokio::test]
async fn a_nul_character_is_400_in_a_body_and_404_in_a_path() {
    let gw = admin().await;
    for (body, field) in [
        (json!({"name": "a\u{0}b"}), "name"),
        (
            json!({"name": "ok", "email": "a\u{0}@example.org"}),
            "email",
        ),
    ] {
        let response = call(
            &gw,
            reqwest::Method::POST,
            "/admin/keys",
            Some(body.clone()),
        )
        .await;
        let error = expect_error(response, 400, "invalid_request").await;
        assert_eq!(
            error["error"]["message"],
            format!("{field} must not contain a NUL character (\\u0000)"),
            "{body}: {error}"
        );
    }
    let keys = get_json(&gw, "/admin/keys").await;
    assert_eq!(
        keys.as_array().unwrap().len(),
        1,
        "only the gateway's own key: {keys}"
    );
    for (method, path, body) in [
        (reqwest::Method::GET, "/admin/keys/%00", None),
        (reqwest::Method::POST, "/admin/keys/fg-%00/revoke", None),
        (
            reqwest::Method::PATCH,
            "/admin/keys/1%00/limits",
            Some(json!({"max_queued": 3})),
        ),
        (reqwest::Method::GET, "/admin/keys/%00/usage", None),
    ] {
        let response = call(&gw, method.clone(), path, body).await;
        expect_error(response, 404, "key_not_found").await;
    }
}

/// A `{key}` that is no UTF-8 once percent-decoded (`%FF`) is 400 `invalid_request` on
/// every route that takes one, and each of them documents that 400.
#[tokio::test]
async fn a_key_that_is_not_utf8_is_a_documented_400() {
    let gw = admin().await;
    let doc = serde_json::to_value(fleetgate::http::router::openapi_document()).unwrap();
    for (method, template, body) in [
        (reqwest::Method::GET, "/admin/keys/{key}", None),
        (reqwest::Method::POST, "/admin/keys/{key}/revoke", None),
        (
            reqwest::Method::PATCH,
            "/admin/keys/{key}/limits",
            Some(json!({"max_queued": 3})),
        ),
        (reqwest::Method::GET, "/admin/keys/{key}/usage", None),
    ] {
        let path = template.replace("{key}", "%FF");
        let response = call(&gw, method.clone(), &path, body).await;
        let error = expect_error(response, 400, "invalid_request").await;
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("UTF-8"),
            "{method} {path}: {error}"
        );
        let operation = &doc["paths"][template][method.as_str().to_lowercase()];
        assert!(
            operation["responses"]["400"].is_object(),
            "{method} {template} does not document its 400"
        );
    }
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

/// With `admin_listen`, the admin API is there and only there: the public listener does
/// not know `/admin`, so a token that leaked is of no use from where the clients are.
#[tokio::test]
async fn the_admin_api_can_be_served_on_a_listener_of_its_own() {
    let address = crate::abuse_connections::free_address().await;
    let gw = Gateway::start_with(
        MockConfig::default(),
        &format!("admin_token = \"{TOKEN}\"\nadmin_listen = \"{address}\""),
    )
    .await;
    let public = call(&gw, reqwest::Method::GET, "/admin/keys", None).await;
    expect_error(public, 404, "not_found").await;
    // Bound while the gateway starts, after the test has its handle.
    drop(crate::abuse_connections::connect_to(&address).await);
    let admin_url = format!("http://{address}/admin/keys");
    let listed = gw
        .client
        .get(&admin_url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 200);
    let keys: Value = listed.json().await.unwrap();
    assert!(
        !keys.as_array().unwrap().is_empty(),
        "the test key is listed: {keys}"
    );
    let unauthorized = gw.client.get(&admin_url).send().await.unwrap();
    assert_eq!(unauthorized.status(), 401);
    let api = gw
        .client
        .get(format!("http://{address}/v1/models"))
        .bearer_auth(&gw.key)
        .send()
        .await
        .unwrap();
    assert_eq!(
        api.status(),
        404,
        "only the admin API is on the admin listener"
    );
}
