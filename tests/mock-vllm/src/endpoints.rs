//! The small routes: `/v1/models`, `/tokenize`, `/health`, `/version`,
//! `/metrics` and FastAPI's 404/405 bodies; and the never-ending body of the
//! `Endless` failure mode.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::config::{FailureMode, ReceivedRequest};
use super::error::VllmError;
use super::lax::Fields;
use super::request::json_body;
use super::state::Shared;

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn json_response(status: StatusCode, value: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

/// Read the body and log the request (for `received()`).
pub(crate) async fn receive(
    shared: &Shared,
    request: Request,
) -> Result<ReceivedRequest, Response> {
    let (parts, body) = request.into_parts();
    let body = to_bytes(body, usize::MAX)
        .await
        .map_err(|_| StatusCode::BAD_REQUEST.into_response())?;
    let received = ReceivedRequest {
        method: parts.method.to_string(),
        path: parts.uri.path().to_owned(),
        headers: parts.headers,
        body,
    };
    shared.record(received.clone());
    Ok(received)
}

/// 200 with a JSON body that starts well and never ends (the `Endless` mode): 64 KiB
/// of blanks at a time, as fast as the client reads, each counted as sent.
fn endless(shared: &Arc<Shared>) -> Response {
    const OPENING: &[u8] = b"{\"object\":\"list\",\"data\":[";
    let blanks = bytes::Bytes::from(vec![b' '; 64 * 1024]);
    let shared = Arc::clone(shared);
    let chunks = futures_util::stream::iter(std::iter::once(bytes::Bytes::from_static(OPENING)))
        .chain(futures_util::stream::repeat(blanks))
        .map(move |chunk| {
            shared
                .endless_sent
                .fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
            Ok::<_, std::io::Error>(chunk)
        });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(chunks),
    )
        .into_response()
}

pub(crate) async fn models(State(shared): State<Arc<Shared>>) -> Response {
    shared.hang_if_wedged().await;
    if shared.failure() == FailureMode::Endless {
        return endless(&shared);
    }
    let created = now_secs();
    let name = &shared.config.served_model_name;
    let card = json!({
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": name,
        "parent": null,
        "max_model_len": shared.config.max_model_len,
        "permission": [{
            "id": format!("modelperm-{}", uuid::Uuid::new_v4().simple()),
            "object": "model_permission",
            "created": created,
            "allow_create_engine": false,
            "allow_sampling": true,
            "allow_logprobs": true,
            "allow_search_indices": false,
            "allow_view": true,
            "allow_fine_tuning": false,
            "organization": "*",
            "group": null,
            "is_blocking": false,
        }],
    });
    json_response(StatusCode::OK, &json!({"object": "list", "data": [card]}))
}

/// `POST /tokenize`, completion form only (`prompt` must be a string; no length check);
/// received, then no answer in the `Hang` mode.
pub(crate) async fn tokenize(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let received = match receive(&shared, request).await {
        Ok(r) => r,
        Err(response) => return response,
    };
    shared.hang_if_wedged().await;
    if shared.failure() == FailureMode::Endless {
        return endless(&shared);
    }
    match tokenize_body(&shared, &received) {
        Ok(value) => json_response(StatusCode::OK, &value),
        Err(e) => e.into_response(),
    }
}

fn tokenize_body(shared: &Shared, received: &ReceivedRequest) -> Result<Value, VllmError> {
    let map = json_body(&received.headers, &received.body)?;
    if map.contains_key("messages") {
        return Err(VllmError::bad_request(
            "mock-vllm serves a base model: the chat form of /tokenize is not supported",
        ));
    }
    let mut f = Fields::new(&map);
    let model = f.string("model");
    let prompt = f.string("prompt");
    let add_special_tokens = f.bool("add_special_tokens", false).unwrap_or(true);
    let return_token_strs = f.bool("return_token_strs", true).unwrap_or(false);
    if prompt.is_none() && f.raw("prompt").is_none() {
        f.fail(
            "prompt",
            "missing",
            "Field required",
            &Value::Object(map.clone()),
        );
    }
    f.finish()?;
    let served = shared.config.served_model_name.as_str();
    if let Some(model) = model.as_deref().filter(|m| !m.is_empty() && *m != served) {
        return Err(VllmError::model_not_found(model));
    }
    let tokens = shared
        .tokenizer
        .encode(prompt.as_deref().unwrap_or(""), add_special_tokens);
    let token_strs = return_token_strs.then(|| {
        tokens
            .iter()
            .map(|&id| shared.tokenizer.raw_token(id))
            .collect::<Vec<_>>()
    });
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": shared.config.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}

/// 200 with an empty body; 503 (0.11+ "engine dead") in the `Status500` failure mode;
/// no answer in the `Hang` mode.
pub(crate) async fn health(State(shared): State<Arc<Shared>>) -> StatusCode {
    shared.hang_if_wedged().await;
    if shared.failure() == FailureMode::Status500 {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

pub(crate) async fn version() -> Response {
    json_response(StatusCode::OK, &json!({"version": "0.11.0"}))
}

/// Prometheus text with the load-balancing gauges of the V1 engine and its prefix-cache
/// counters.
pub(crate) async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    if shared.failure() == FailureMode::Endless {
        return endless(&shared);
    }
    shared
        .metrics_read
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let running = shared.running();
    let model = shared
        .config
        .served_model_name
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    let labels = format!("{{engine=\"0\",model_name=\"{model}\"}}");
    let kv = shared.kv_cache_usage();
    let gauges = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            shared.waiting() as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            kv,
        ),
    ];
    let mut text = String::new();
    for (name, help, value) in gauges {
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{labels} {value:?}\n"
        ));
    }
    // Counters as Python's prometheus_client writes them: `_total` samples, and a
    // `_created` gauge beside each.
    let (queries, hits) = shared.prefix_cache.counters();
    let counters = [
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            hits,
        ),
    ];
    for (name, help, value) in counters {
        text.push_str(&format!(
            "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{labels} {:?}\n",
            value as f64
        ));
        text.push_str(&format!(
            "# HELP {name}_created {help}\n# TYPE {name}_created gauge\n{name}_created{labels} {:?}\n",
            shared.started_secs as f64
        ));
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        Body::from(text),
    )
        .into_response()
}

pub(crate) async fn not_found() -> Response {
    json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}))
}

pub(crate) async fn method_not_allowed() -> Response {
    json_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &json!({"detail": "Method Not Allowed"}),
    )
}
