//! Reading a JSON request body: the content type is checked and the size is limited
//! before any of it is parsed.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::error::ApiError;

/// Checks that the request says it carries JSON (`application/json`, parameters allowed).
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = content_type.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    let got = if content_type.is_empty() {
        "none".to_owned()
    } else {
        format!("'{}'", content_type.chars().take(60).collect::<String>())
    };
    Err(ApiError::invalid(format!(
        "Content-Type must be application/json (got {got})."
    )))
}

/// Reads the whole body, refusing more than `limit` bytes with 413 (early, from
/// `Content-Length`, when the client declares it) and a body still incomplete after
/// `timeout` with 408: a client trickling bytes holds a request for that long at most.
pub async fn read_limited(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let read = tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await;
    let Ok(read) = read else {
        return Err(ApiError::RequestTimeout { limit: timeout });
    };
    match read {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::PayloadTooLarge { limit })
        }
        Err(_) => Err(ApiError::invalid("The request body could not be read.")),
    }
}

/// A JSON body read by axum's `Json` extractor; its rejection (bad JSON, a wrong type,
/// an unknown field, a missing content type) becomes a 400 whose message is axum's.
pub fn json_body<T>(
    payload: Result<axum::Json<T>, axum::extract::rejection::JsonRejection>,
) -> Result<T, ApiError> {
    payload
        .map(|axum::Json(value)| value)
        .map_err(|rejection| ApiError::invalid(rejection.body_text()))
}
