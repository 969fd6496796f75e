//! The envelope: every request gets an id, every response carries it in `X-Request-Id`,
//! and every error is rendered as the OpenAI envelope carrying the same id. It is the
//! outermost step of every request (see `every_request`; the ops listener has it as its
//! only middleware).
//!
//! Errors raised by our code arrive as an [`ErrorBody`] extension (see `error.rs`). An
//! error status without one was produced by the framework itself (a rejected extractor,
//! a panic caught below us); it is re-rendered here so no bare framework body escapes.
//! An error found before there is a request at all is rendered the same way by
//! [`unrouted`]. A response marked [`OwnBody`] (a 503 from `/ready` saying why) is the
//! answer itself and is left as it is.

use axum::body::Body;
use axum::extract::Request;
use axum::http::response::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::contract::X_REQUEST_ID;
use crate::error::{ApiError, ErrorBody};

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

/// The envelope as a middleware of its own (the ops listener's; the main listener's
/// requests get theirs from [`crate::http::every_request`]).
pub async fn envelope(mut request: Request, next: Next) -> Response {
    let id = RequestId::generate();
    request.extensions_mut().insert(id.clone());
    enveloped(next.run(request).await, &id).await
}

/// `response` with its error (if any) rendered as the envelope and `X-Request-Id` set.
pub async fn enveloped(mut response: Response, id: &RequestId) -> Response {
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
