//! Key rotation and expiry through the admin API, as a key's holder sees them: a
//! rotated key keeps its id, prefix, limits and usage, and its old secret works until
//! the grace ends; an expired key is refused with the same 401 as an unknown one, its
//! message saying when it expired; `/v1/usage` says when either happens.

use std::time::{Duration, Instant};

use crate::admin::{TOKEN, admin, call};
use crate::common::{Gateway, MODEL, expect_error};
use fleetgate::store::now_unix as now;
use serde_json::{Value, json};

/// The longest a short grace (or expiry) of a test may take to be seen ending.
const SOON: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(50);

async fn ok_json(response: reqwest::Response) -> Value {
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

async fn rotate(gw: &Gateway, prefix: &str, body: Option<Value>) -> Value {
    let path = format!("/admin/keys/{prefix}/rotate");
    ok_json(call(gw, reqwest::Method::POST, &path, body).await).await
}

/// `GET /v1/usage` with `secret`: the usage, or the refusal's envelope (401).
async fn usage_or_refusal(gw: &Gateway, secret: &str) -> Result<Value, Value> {
    let response = gw
        .client
        .get(format!("{}/v1/usage", gw.url))
        .bearer_auth(secret)
        .send()
        .await
        .unwrap();
    if response.status() == 200 {
        Ok(response.json().await.unwrap())
    } else {
        Err(expect_error(response, 401, "invalid_api_key").await)
    }
}

fn message(refusal: &Value) -> &str {
    refusal["error"]["message"].as_str().unwrap()
}

/// Polls until `secret` is refused; returns the refusal.
async fn refused_within(gw: &Gateway, secret: &str, limit: Duration) -> Value {
    let since = Instant::now();
    loop {
        match usage_or_refusal(gw, secret).await {
            Err(refusal) => return refusal,
            Ok(_) => assert!(
                since.elapsed() < limit,
                "still accepted after {:?}",
                since.elapsed()
            ),
        }
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test]
async fn a_rotated_key_keeps_everything_and_its_old_secret_works_until_the_grace_ends() {
    let gw = admin().await;
    let created = call(
        &gw,
        reqwest::Method::POST,
        "/admin/keys",
        Some(json!({"name": "rotating", "monthly_budget": 1000, "max_queued": 2})),
    )
    .await;
    assert_eq!(created.status(), 201);
    let created: Value = created.json().await.unwrap();
    let old = created["secret"].as_str().unwrap().to_owned();
    let prefix = created["prefix"].as_str().unwrap().to_owned();
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 3}).to_string();
    let response = gw.complete_as(&old, &body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    let before = gw.usage(&old).await;
    assert!(before["used"].as_u64().unwrap() > 0, "{before}");
    assert_eq!(before["previous_secret_expires_at"], Value::Null);
    assert_eq!(before["expires_at"], Value::Null);

    let asked = now();
    let rotated = rotate(&gw, &prefix, Some(json!({"grace_seconds": 2}))).await;
    let new = rotated["secret"].as_str().unwrap().to_owned();
    assert_ne!(new, old);
    assert!(new.starts_with(&prefix), "the key keeps its prefix");
    for field in ["id", "prefix", "name", "created_at", "limits", "overrides"] {
        assert_eq!(rotated[field], created[field], "{field}");
    }
    let grace_end = rotated["previous_secret_expires_at"].as_i64().unwrap();
    assert!((asked + 2..=now() + 2).contains(&grace_end), "{rotated}");
    let shown = ok_json(
        call(
            &gw,
            reqwest::Method::GET,
            &format!("/admin/keys/{prefix}"),
            None,
        )
        .await,
    )
    .await;
    assert_eq!(shown["previous_secret_expires_at"], grace_end);
    assert!(shown.get("secret").is_none(), "shown once only: {shown}");

    // During the grace both secrets are the same key: same usage, same limits.
    for secret in [&old, &new] {
        let usage = usage_or_refusal(&gw, secret).await.unwrap();
        for field in ["key_prefix", "used", "monthly_budget", "max_queued"] {
            assert_eq!(usage[field], before[field], "{field}");
        }
        assert_eq!(usage["previous_secret_expires_at"], grace_end);
    }

    // Then only the new one, and the old one is told why.
    let refusal = refused_within(&gw, &old, SOON).await;
    assert!(
        message(&refusal).starts_with(
            "This secret was replaced by a new one (the key was rotated) and stopped working at "
        ),
        "{refusal}"
    );
    let after = usage_or_refusal(&gw, &new).await.unwrap();
    assert_eq!(after["previous_secret_expires_at"], Value::Null);
    assert_eq!(after["used"], before["used"]);
    let response = gw.complete_as(&new, &body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
}

/// A grace of 0 stops the old secret at once; a rotation during a grace keeps only the
/// secret it replaces; without a body the grace is a day.
#[tokio::test]
async fn no_grace_a_second_rotation_and_the_default_grace() {
    let gw = admin().await;
    let first = gw.key.clone();
    let prefix = &first[..12];

    // No body at all (`Content-Length: 0`, even with a JSON content type): the default.
    let response = gw
        .client
        .post(format!("{}/admin/keys/{prefix}/rotate", gw.url))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    let second = ok_json(response).await;
    let asked = now();
    let grace_end = second["previous_secret_expires_at"].as_i64().unwrap();
    assert!(
        (asked + 86_400 - 5..=asked + 86_400).contains(&grace_end),
        "a day by default: {second}"
    );
    let second = second["secret"].as_str().unwrap().to_owned();
    usage_or_refusal(&gw, &first).await.unwrap();

    // Rotated again during the grace: the secret just replaced keeps working, the
    // first stops at once (and is as unknown: it is no longer kept).
    let third = rotate(&gw, prefix, Some(json!({"grace_seconds": 600}))).await;
    let third = third["secret"].as_str().unwrap().to_owned();
    let refusal = usage_or_refusal(&gw, &first).await.unwrap_err();
    assert_eq!(message(&refusal), "Invalid API key.");
    usage_or_refusal(&gw, &second).await.unwrap();
    usage_or_refusal(&gw, &third).await.unwrap();

    let fourth = rotate(&gw, prefix, Some(json!({"grace_seconds": 0}))).await;
    assert_eq!(fourth["previous_secret_expires_at"], Value::Null);
    let fourth = fourth["secret"].as_str().unwrap().to_owned();
    for gone in [&second, &third] {
        let refusal = usage_or_refusal(&gw, gone).await.unwrap_err();
        assert_eq!(message(&refusal), "Invalid API key.");
    }
    let usage = usage_or_refusal(&gw, &fourth).await.unwrap();
    assert_eq!(usage["previous_secret_expires_at"], Value::Null);
}

#[tokio::test]
async fn a_bad_rotation_is_refused_and_changes_nothing() {
    let gw = admin().await;
    let prefix = gw.key[..12].to_owned();
    let path = format!("/admin/keys/{prefix}/rotate");
    for (body, said) in [
        (
            json!({"grace_seconds": 2_592_001}),
            "the grace period must be at most 30d (2592000 seconds), got 2592001s (2592001 seconds)",
        ),
        (
            json!({"grace_seconds": -1}),
            "grace_seconds must be a whole number of seconds from 0 to 2592000 (got -1)",
        ),
        (
            json!({"grace_seconds": 1.5}),
            "grace_seconds must be a whole number of seconds from 0 to 2592000 (got 1.5)",
        ),
        (
            json!({"grace_seconds": "1h"}),
            "grace_seconds must be a whole number of seconds from 0 to 2592000 (got \"1h\")",
        ),
    ] {
        let response = call(&gw, reqwest::Method::POST, &path, Some(body.clone())).await;
        let refusal = expect_error(response, 400, "invalid_request").await;
        assert_eq!(
            refusal["error"]["param"], "grace_seconds",
            "{body}: {refusal}"
        );
        assert_eq!(message(&refusal), said);
    }
    let response = call(&gw, reqwest::Method::POST, &path, Some(json!({"grace": 5}))).await;
    expect_error(response, 400, "invalid_request").await;
    let response = gw
        .client
        .post(format!("{}{path}", gw.url))
        .bearer_auth(TOKEN)
        .body("{}")
        .send()
        .await
        .unwrap();
    let refusal = expect_error(response, 400, "invalid_request").await;
    assert!(message(&refusal).contains("Content-Type"), "{refusal}");
    let response = gw
        .client
        .post(format!("{}{path}", gw.url))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    expect_error(response, 400, "invalid_request").await;
    // None of these rotated: the key's only secret still works, with no grace.
    let usage = usage_or_refusal(&gw, &gw.key).await.unwrap();
    assert_eq!(usage["previous_secret_expires_at"], Value::Null);

    let revoke = format!("/admin/keys/{prefix}/revoke");
    ok_json(call(&gw, reqwest::Method::POST, &revoke, None).await).await;
    let response = call(&gw, reqwest::Method::POST, &path, None).await;
    let refusal = expect_error(response, 400, "invalid_request").await;
    assert!(message(&refusal).contains("is revoked"), "{refusal}");
}

#[tokio::test]
async fn an_expired_key_is_refused_saying_when_it_expired() {
    let gw = admin().await;
    let created = call(
        &gw,
        reqwest::Method::POST,
        "/admin/keys",
        Some(json!({"name": "temp", "expires_at": "2099-01-01T00:00:00Z"})),
    )
    .await;
    assert_eq!(created.status(), 201);
    let created: Value = created.json().await.unwrap();
    assert_eq!(created["expires_at"], 4_070_908_800_i64);
    assert_eq!(created["active"], true);
    let secret = created["secret"].as_str().unwrap().to_owned();
    let prefix = created["prefix"].as_str().unwrap().to_owned();
    let usage = usage_or_refusal(&gw, &secret).await.unwrap();
    assert_eq!(usage["expires_at"], 4_070_908_800_i64);

    // Expired (a time already past): refused at once, as an unknown key is (401
    // `invalid_api_key`, the same envelope), but saying so.
    let limits = format!("/admin/keys/{prefix}/limits");
    let patched = ok_json(
        call(
            &gw,
            reqwest::Method::PATCH,
            &limits,
            Some(json!({"expires_at": 1_000_000_000})),
        )
        .await,
    )
    .await;
    assert_eq!(
        (&patched["expires_at"], &patched["active"]),
        (&json!(1_000_000_000), &json!(false))
    );
    let expired = usage_or_refusal(&gw, &secret).await.unwrap_err();
    assert_eq!(
        message(&expired),
        "This API key expired at 2001-09-09T01:46:40Z. Ask its administrator for a new expiry or a new key."
    );
    let unknown = usage_or_refusal(&gw, &format!("fg-{}", "A".repeat(43)))
        .await
        .unwrap_err();
    let keys = |v: &Value| {
        let mut keys: Vec<String> = v["error"].as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    };
    assert_eq!(keys(&expired), keys(&unknown), "the same envelope");
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 3}).to_string();
    let response = gw.complete_as(&secret, &body).send().await.unwrap();
    let refusal = expect_error(response, 401, "invalid_api_key").await;
    assert_eq!(message(&refusal), message(&expired));

    // Cleared: the key works again. Then an expiry a second ahead ends on its own.
    let patched = ok_json(
        call(
            &gw,
            reqwest::Method::PATCH,
            &limits,
            Some(json!({"expires_at": null})),
        )
        .await,
    )
    .await;
    assert_eq!(patched["expires_at"], Value::Null);
    usage_or_refusal(&gw, &secret).await.unwrap();
    let soon = now() + 1;
    call(
        &gw,
        reqwest::Method::PATCH,
        &limits,
        Some(json!({"expires_at": soon})),
    )
    .await;
    let refusal = refused_within(&gw, &secret, SOON).await;
    assert!(
        message(&refusal).starts_with("This API key expired at "),
        "{refusal}"
    );
}

#[tokio::test]
async fn a_bad_expiry_is_400_naming_expires_at() {
    let gw = admin().await;
    let prefix = gw.key[..12].to_owned();
    let limits = format!("/admin/keys/{prefix}/limits");
    for bad in [
        json!("tomorrow"),
        json!("2027-01-01T00:00:00"),
        json!(true),
        json!(1.5),
        json!(-1),
        json!(253_402_300_800_i64),
    ] {
        for (method, path, body) in [
            (
                reqwest::Method::POST,
                "/admin/keys",
                json!({"name": "x", "expires_at": bad}),
            ),
            (
                reqwest::Method::PATCH,
                limits.as_str(),
                json!({"max_queued": 5, "expires_at": bad}),
            ),
        ] {
            let response = call(&gw, method, path, Some(body)).await;
            let refusal = expect_error(response, 400, "invalid_request").await;
            assert_eq!(refusal["error"]["param"], "expires_at", "{bad}: {refusal}");
        }
    }
    let usage = usage_or_refusal(&gw, &gw.key).await.unwrap();
    assert_eq!(usage["expires_at"], Value::Null, "nothing changed");
    let view = call(
        &gw,
        reqwest::Method::GET,
        &format!("/admin/keys/{prefix}"),
        None,
    )
    .await;
    let view: Value = view.json().await.unwrap();
    assert_eq!(
        view["overrides"]["max_queued"],
        Value::Null,
        "nor the limits beside the bad expiry: {view}"
    );
}
