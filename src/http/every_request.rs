//! What runs around every request, outside-in. On the main listener it is one
//! middleware ([`every_request`]):
//! 1. its id ([`RequestId`]), given before anything else;
//! 2. its span (`span_of`), which the rest runs in; with traces on, it continues
//!    a client's `traceparent` only when the request shows a credential that holds
//!    ([`auth::shows_credential`]): anybody else's sampled flag would make the gateway
//!    export the traces of their noise, whatever `traces.sample_ratio` says. Their
//!    requests start traces of their own, kept at `sample_ratio`;
//! 3. its record (`recorded`: the front door's part of `crate::request_record`), which
//!    sees each error's code and catches a panic beneath it as a 500 (`caught`);
//! 4. on the way out, the envelope (`enveloped`) renders the error (if any) with the
//!    id, and sets `X-Request-Id`.
//!
//! The ops listener's requests get the id and the envelope only ([`envelope`], its one
//! middleware).
//!
//! One middleware rather than one a step: each `from_fn` layer boxes the future of the
//! rest and moves the request (a few hundred bytes) once more, for every request.
//!
//! **The envelope**: every response carries the request id in `X-Request-Id`, and every
//! error is rendered as the OpenAI envelope carrying the same id. Errors raised by our
//! code arrive as an [`ErrorBody`] extension (see `error.rs`). An error status without
//! one was produced by the framework itself (a rejected extractor, a panic caught below
//! us); it is re-rendered here so no bare framework body escapes. An error found before
//! there is a request at all is rendered the same way by [`unrouted`]. A response
//! marked [`OwnBody`] (a 503 from `/ready` saying why) is the answer itself and is left
//! as it is.
//!
//! **The span** carries method, path and request id; never headers or bodies. Only the
//! handler's future is instrumented, not the response body: tower-http's `TraceLayer`
//! enters its span again for every frame of the body, which for a relayed stream is a
//! registry look-up per SSE frame for nothing. The relay logs nothing while it streams,
//! and the request's line, written when a stream's body ends, enters the span itself
//! (the request record holds it until then). So the span, and with traces on the
//! request's trace, still covers the whole answer.
//!
//! **The record**: every API request gets one, opened before the route runs and given
//! the response's status and error code when it is ready.
//!
//! **A panic** while a request is handled is answered as a 500 `internal_error` (which
//! the envelope renders with the request id), not with a dropped connection. The record
//! catches it around everything beneath it, rather than tower-http's catch-panic layer:
//! as a layer of its own that boxes every response body once more, one more layer for
//! every frame of every stream to pass through. As with that layer, a panic while a
//! body is being sent is not caught: the connection ends.

use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::response::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use tracing::Instrument;

use crate::contract::{Workload, X_ACS_WORKLOAD, X_REQUEST_ID};
use crate::error::{ApiError, ErrorBody};
use crate::http::auth;
use crate::request_record::RequestRecord;
use crate::state::AppState;
use crate::traces;

/// The W3C trace context header a client may send.
const TRACEPARENT: &str = "traceparent";

/// Framework error bodies are short texts; read at most this much of one.
const FRAMEWORK_BODY_LIMIT: usize = 4 * 1024;

/// Marks an error-status response whose body is the answer (the ops routes' 503s carry
/// the state that caused them), not an error to put in the envelope.
#[derive(Debug, Clone, Copy)]
pub struct OwnBody;

/// The id of the request being served, available to handlers as an extension.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

impl RequestId {
    /// `req_` and a UUIDv7: unique, and ordered by time, so the ledger's and the request
    /// log's unique indexes on it take each new id at their right edge (a random v4 id
    /// lands on a random page: with a grown database, a page read and a page written
    /// per insert).
    pub fn generate() -> Self {
        Self(format!("req_{}", uuid::Uuid::now_v7().simple()))
    }
}

/// What the middleware needs: the state, and whether requests are traced (fixed at
/// start, as the tracing layers are).
#[derive(Clone)]
pub struct EveryRequest {
    pub state: AppState,
    pub traced: bool,
}

pub async fn every_request(
    State(every): State<EveryRequest>,
    mut request: Request,
    next: Next,
) -> Response {
    let id = RequestId::generate();
    request.extensions_mut().insert(id.clone());
    // The key is looked up only when there is a client trace to follow.
    let follow_client = every.traced
        && request.headers().contains_key(TRACEPARENT)
        && auth::shows_credential(&every.state, request.headers());
    let span = span_of(&request, &id.0, follow_client);
    let response = recorded(&every.state, &id.0, request, next)
        .instrument(span.clone())
        .await;
    if every.traced {
        span.record("status", i64::from(response.status().as_u16()));
    }
    enveloped(response, &id).await
}

/// The envelope as a middleware of its own (the ops listener's; the main listener's
/// requests get theirs from [`every_request`]).
pub async fn envelope(mut request: Request, next: Next) -> Response {
    let id = RequestId::generate();
    request.extensions_mut().insert(id.clone());
    enveloped(next.run(request).await, &id).await
}

/// `response` with its error (if any) rendered as the envelope and `X-Request-Id` set.
async fn enveloped(mut response: Response, id: &RequestId) -> Response {
    let error = match response.extensions_mut().remove::<ErrorBody>() {
        Some(error) => Some(error),
        None if is_error(response.status()) && response.extensions().get::<OwnBody>().is_none() => {
            Some(framework_error(&mut response).await)
        }
        None => None,
    };
    if let Some(error) = error {
        let body = render(response.headers_mut(), &error, id);
        *response.body_mut() = Body::from(body);
    }
    tag(response.headers_mut(), id);
    response
}

/// The answer to `error` when it is found below the router, where there is no request to
/// give an id to (a request head hyper could not parse: see `connections`): its status,
/// its headers and envelope body as [`envelope`] renders them, with an id of its own.
pub fn unrouted(error: ApiError) -> (Parts, Vec<u8>) {
    let id = RequestId::generate();
    let body = error.body();
    let (mut parts, _) = error.into_response().into_parts();
    let body = render(&mut parts.headers, &body, &id);
    tag(&mut parts.headers, &id);
    (parts, body)
}

/// Puts the request id in `X-Request-Id`.
fn tag(headers: &mut HeaderMap, id: &RequestId) {
    if let Ok(value) = HeaderValue::from_str(&id.0) {
        headers.insert(X_REQUEST_ID, value);
    }
}

fn is_error(status: StatusCode) -> bool {
    status.is_client_error() || status.is_server_error()
}

/// Sets the envelope's headers and returns its body.
fn render(headers: &mut HeaderMap, error: &ErrorBody, id: &RequestId) -> Vec<u8> {
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.remove(header::CONTENT_LENGTH);
    error.envelope_json(&id.0)
}

/// An envelope for an error response the framework produced, keeping its text as the
/// message (e.g. an extractor's explanation).
async fn framework_error(response: &mut Response) -> ErrorBody {
    let status = response.status();
    let body = std::mem::take(response.body_mut());
    let text = axum::body::to_bytes(body, FRAMEWORK_BODY_LIMIT)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let (code, kind) = match status {
        StatusCode::NOT_FOUND => ("not_found", "invalid_request_error"),
        StatusCode::METHOD_NOT_ALLOWED => ("method_not_allowed", "invalid_request_error"),
        StatusCode::PAYLOAD_TOO_LARGE => ("request_too_large", "invalid_request_error"),
        StatusCode::UNAUTHORIZED => ("invalid_api_key", "authentication_error"),
        s if s.is_server_error() => ("internal_error", "server_error"),
        _ => ("invalid_request", "invalid_request_error"),
    };
    let message = if text.is_empty() || status.is_server_error() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    ErrorBody {
        code,
        message,
        kind,
        param: None,
    }
}

/// The span of `request`, whose id is `request_id`. With traces on, the span is the root
/// of the request's trace, or continues the client's `traceparent` when
/// `follow_client` (only for an authenticated request, see [`every_request`]), and the
/// status is recorded into it when the response is ready.
///
/// The key prefix is recorded into it once the key is known (see `auth`); the model
/// (see the completion pipeline) and the status only when `traced`, since a field
/// recorded later costs the log's formatter an allocation per request.
fn span_of(request: &Request, request_id: &str, follow_client: bool) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        request_id,
        key_prefix = tracing::field::Empty,
        model = tracing::field::Empty,
        status = tracing::field::Empty,
    );
    if follow_client {
        traces::continue_trace(&span, request.headers());
    }
    span
}

/// `X-Acs-Workload` when it is one of the two known values; others are ignored.
pub fn workload(headers: &HeaderMap) -> Option<Workload> {
    headers
        .get(X_ACS_WORKLOAD)
        .and_then(|v| v.to_str().ok())
        .and_then(Workload::parse)
}

/// Runs the rest of an API request under its record, opened here and released when the
/// response is ready (a streaming body holds it on); inside the envelope, so it sees
/// each error's code before the envelope renders it. A panic beneath it is answered
/// (and recorded) as a 500 (`caught`).
async fn recorded(
    state: &AppState,
    request_id: &str,
    mut request: Request,
    next: Next,
) -> Response {
    // Only API requests are recorded: health probes, metric scrapes and the docs would
    // drown the log (and the request metrics) in noise.
    if !is_api_path(request.uri().path()) {
        return caught(next.run(request)).await;
    }
    let workload = workload(request.headers());
    let client_ip = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip());
    let endpoint = request.uri().path().chars().take(256).collect();
    let record = RequestRecord::open(state, request_id.to_owned(), endpoint, workload, client_ip);
    request.extensions_mut().insert(record.clone());
    let response = caught(next.run(request)).await;
    let error_code = response.extensions().get::<ErrorBody>().map(|e| e.code);
    record.set_outcome(response.status().as_u16(), error_code);
    record.release();
    response
}

fn is_api_path(path: &str) -> bool {
    path.starts_with("/v1/") || path.starts_with("/admin/") || path == "/admin"
}

/// `answer`, or a 500 if it panics.
async fn caught(answer: impl Future<Output = Response>) -> Response {
    AssertUnwindSafe(answer)
        .catch_unwind()
        .await
        .unwrap_or_else(|_| ApiError::internal(anyhow::anyhow!("handler panicked")).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_is_answered_as_an_internal_error() {
        let answer = caught(async { panic!("a bug") }).await;
        assert_eq!(answer.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let code = answer.extensions().get::<ErrorBody>().map(|e| e.code);
        assert_eq!(code, Some("internal_error"));
    }

    #[tokio::test]
    async fn an_answer_passes_unchanged() {
        let answer = caught(async { StatusCode::IM_A_TEAPOT.into_response() }).await;
        assert_eq!(answer.status(), StatusCode::IM_A_TEAPOT);
    }
}
