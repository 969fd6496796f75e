//! The router in process (`tower::ServiceExt::oneshot`, no socket): what a client gets
//! for requests the gateway answers before any node is asked — unknown paths, wrong
//! methods, missing or bad keys, unknown body fields — and the OpenAPI document.

use axum::body::Body;
use axum::http::{Method, Request, Response, StatusCode, header};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::common::{App, MODEL};

/// Sends one request through a clone of the router.
async fn send(app: &App, request: Request<Body>) -> Response<Body> {
    app.router.clone().oneshot(request).await.unwrap()
}

/// A request with no headers but the ones given.
fn request(method: Method, path: &str, headers: &[(&str, &str)], body: Body) -> Request<Body> {
    let mut builder = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(body).unwrap()
}

/// `POST /v1/completions` with a JSON body and these `Authorization` headers.
fn completion(authorization: Option<&str>, body: &Value) -> Request<Body> {
    let mut headers = vec![("content-type", "application/json")];
    headers.extend(authorization.map(|value| ("authorization", value)));
    request(
        Method::POST,
        "/v1/completions",
        &headers,
        Body::from(body.to_string()),
    )
}

async fn json_body(response: Response<Body>) -> Value {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {:?}",
            String::from_utf8_lossy(&bytes)
                .chars()
                .take(200)
                .collect::<String>()
        )
    })
}

/// Asserts the status and the OpenAI error envelope with this code, its `request_id`
/// equal to `X-Request-Id`; returns the body.
async fn expect_envelope(response: Response<Body>, status: StatusCode, code: &str) -> Value {
    assert_eq!(response.status(), status, "status");
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/json",
        "content type"
    );
    let header_id = response
        .headers()
        .get("x-request-id")
        .expect("x-request-id on every response")
        .to_str()
        .unwrap()
        .to_owned();
    let body = json_body(response).await;
    assert_eq!(body["error"]["code"], code, "error.code in {body}");
    assert!(body["error"]["type"].is_string(), "type in {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "message in {body}"
    );
    assert_eq!(
        body["request_id"],
        header_id.as_str(),
        "request_id matches X-Request-Id"
    );
    body
}

#[tokio::test]
async fn an_unknown_path_is_a_404_envelope_naming_it_with_the_request_id() {
    let app = App::new().await;
    let key = format!("Bearer {}", app.key);
    let keyed = send(
        &app,
        request(
            Method::GET,
            "/v1/nope",
            &[("authorization", &key)],
            Body::empty(),
        ),
    )
    .await;
    let keyed = expect_envelope(keyed, StatusCode::NOT_FOUND, "not_found").await;
    assert!(
        keyed["error"]["message"]
            .as_str()
            .unwrap()
            .contains("GET /v1/nope"),
        "{keyed}"
    );
    let anonymous = send(
        &app,
        request(Method::POST, "/nothing/here", &[], Body::from("{}")),
    )
    .await;
    let anonymous = expect_envelope(anonymous, StatusCode::NOT_FOUND, "not_found").await;
    assert!(
        anonymous["error"]["message"]
            .as_str()
            .unwrap()
            .contains("POST /nothing/here"),
        "{anonymous}"
    );
    assert_ne!(
        keyed["request_id"], anonymous["request_id"],
        "every request gets its own id"
    );
}

#[tokio::test]
async fn a_wrong_method_on_a_route_is_a_405_envelope() {
    let app = App::new().await;
    let key = format!("Bearer {}", app.key);
    for (method, path) in [
        (Method::GET, "/v1/completions"),
        (Method::DELETE, "/v1/models"),
        (Method::POST, "/health"),
    ] {
        let response = send(
            &app,
            request(
                method.clone(),
                path,
                &[("authorization", &key)],
                Body::empty(),
            ),
        )
        .await;
        let body = expect_envelope(
            response,
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        )
        .await;
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(method.as_str()) && message.contains(path),
            "names the method and the path: {body}"
        );
    }
}

#[tokio::test]
async fn a_missing_or_garbage_authorization_is_a_401_envelope() {
    let app = App::new().await;
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 1});
    let missing = send(&app, completion(None, &body)).await;
    let missing = expect_envelope(missing, StatusCode::UNAUTHORIZED, "invalid_api_key").await;
    assert!(
        missing["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Authorization: Bearer"),
        "says what to send: {missing}"
    );
    // The right key under the wrong scheme, one character short, and one character
    // changed past its prefix (well-formed, found by the prefix, wrong hash).
    let wrong_scheme = format!("Basic {}", app.key);
    let truncated = format!("Bearer {}", &app.key[..app.key.len() - 1]);
    let changed = if app.key.as_bytes()[20] == b'A' {
        "B"
    } else {
        "A"
    };
    let changed = format!("Bearer {}{changed}{}", &app.key[..20], &app.key[21..]);
    for garbage in [
        "",
        "Bearer",
        "Basic abc",
        "Bearer not-a-key",
        "Bearer fg-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        &wrong_scheme,
        &truncated,
        &changed,
    ] {
        let response = send(&app, completion(Some(garbage), &body)).await;
        assert_eq!(
            response.status(),
            StatusCode::UNAUTHORIZED,
            "Authorization: {garbage:?}"
        );
        expect_envelope(response, StatusCode::UNAUTHORIZED, "invalid_api_key").await;
    }
}

#[tokio::test]
async fn an_unknown_body_field_is_a_400_naming_the_field() {
    let app = App::new().await;
    let key = format!("Bearer {}", app.key);
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temprature": 0.5});
    // With a good key: the refusal is the body's.
    let response = send(&app, completion(Some(&key), &body)).await;
    let error = expect_envelope(response, StatusCode::BAD_REQUEST, "invalid_request").await;
    assert_eq!(error["error"]["param"], "temprature", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'temprature'"),
        "{error}"
    );
}

#[tokio::test]
async fn the_openapi_document_is_served_without_a_key() {
    let app = App::new().await;
    let response = send(
        &app,
        request(Method::GET, "/openapi.json", &[], Body::empty()),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().contains_key("x-request-id"));
    let served = json_body(response).await;
    assert_eq!(
        served,
        serde_json::to_value(fleetgate::http::router::openapi_document()).unwrap(),
        "the served document is the code's"
    );
    assert!(
        served["paths"]["/v1/completions"]["post"].is_object(),
        "documents POST /v1/completions"
    );
}
