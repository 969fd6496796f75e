//! Reading a JSON request body: the content type is checked, and the size and the time
//! it may take to arrive are limited, before any of it is parsed. Every route that reads
//! a body reads it here: `POST /v1/completions` with [`read_limited`], every other one
//! through [`JsonBody`].
//!
//! What one key's request bodies hold while they are read is bounded too ([`Reading`]).
//! A body is read whole before the request is admitted (up to `max_body_bytes`, within
//! `body_read_timeout_ms`), so without a bound a key with many connections could upload
//! many large bodies slowly at once and take the process's memory from everyone. Each
//! key's bodies being read hold at most `connections.reading_bytes_per_key` (counted by
//! their declared length, or their limit when they declare none); beyond it the request
//! gets 429 `queue_full` at once, before a byte of its body is read, as the contract
//! answers "rather than consuming unbounded memory".

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::DeserializeOwned;

use crate::error::ApiError;
use crate::http::auth::Caller;
use crate::http::held::{Held, Hold};
use crate::state::AppState;

/// The most a JSON body of a route other than `POST /v1/completions` may hold (a
/// Workbench item, a Loom tree, an admin call), or `max_body_bytes` if that is less.
/// These are kept in the store, not passed on to a model: none comes near it.
pub const RECORD_BODY_LIMIT: usize = 2 * 1024 * 1024;

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

/// A JSON body, read by [`read_limited`] — at most [`RECORD_BODY_LIMIT`] bytes, whole
/// within `connections.body_read_timeout_ms` — then parsed by axum's `Json`, whose
/// rejection (a missing content type, bad JSON, a wrong type, an unknown field) becomes
/// a 400 with axum's message.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned + Send> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        let config = state.config();
        let limit = config.max_body_bytes.min(RECORD_BODY_LIMIT);
        let timeout = Duration::from_millis(config.connections.body_read_timeout_ms);
        let (parts, body) = request.into_parts();
        // A key's bodies share its bound while read (admin calls have no key: trusted).
        let _reading = match (
            parts.extensions.get::<Caller>(),
            parts.extensions.get::<Arc<Reading>>(),
        ) {
            (Some(caller), Some(reading)) => {
                Some(reading.hold(caller.0.id, &parts.headers, limit)?)
            }
            _ => None,
        };
        let bytes = read_limited(&parts.headers, body, limit, timeout).await?;
        // Whole already, and within axum's own limit (2 MiB, as RECORD_BODY_LIMIT).
        let request = Request::from_parts(parts, Body::from(bytes));
        axum::Json::<T>::from_request(request, state)
            .await
            .map(|axum::Json(value)| Self(value))
            .map_err(|rejection| ApiError::invalid(rejection.body_text()))
    }
}

/// When to try an upload again that found its key's bodies at their bound: an upload
/// of the key's is likely done by then.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The bytes each key's bodies being read hold now.
pub struct Reading {
    per_key: usize,
    held: Arc<Held<i64>>,
}

/// A body's share of its key's bound, given back when dropped (read, refused or gone).
pub type ReadingHold = Hold<i64>;

impl Reading {
    pub fn new(per_key: usize) -> Arc<Self> {
        Arc::new(Self {
            per_key,
            held: Held::new(),
        })
    }

    /// Holds what a body of `key`'s will take (its `Content-Length`, else `limit`), or
    /// refuses with 429 `queue_full` when its key's bodies would hold more than the bound.
    pub fn hold(
        &self,
        key: i64,
        headers: &HeaderMap,
        limit: usize,
    ) -> Result<ReadingHold, ApiError> {
        let bytes = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(limit, |declared| declared.min(limit));
        // One body is always let through, whatever its size: a key is never locked out.
        let fits = |now: usize| now == 0 || now.saturating_add(bytes) <= self.per_key;
        self.held
            .hold(key, bytes, fits)
            .map_err(|held| ApiError::BodiesBeingRead {
                held,
                limit: self.per_key,
                retry_after: RETRY_AFTER,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declaring(len: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, len.into());
        headers
    }

    #[test]
    fn a_keys_bodies_hold_at_most_the_bound_and_give_it_back() {
        let reading = Reading::new(100);
        let first = reading.hold(1, &declaring(60), 1000).unwrap();
        let refused = reading.hold(1, &declaring(60), 1000).err().unwrap();
        assert_eq!(refused.code(), "queue_full");
        // Another key is not held back by this one's uploads.
        let other = reading.hold(2, &declaring(60), 1000).unwrap();
        drop(first);
        let again = reading.hold(1, &HeaderMap::new(), 50).unwrap();
        assert_eq!(
            again.amount(),
            50,
            "a body that declares no length holds its limit"
        );
        drop((other, again));
        assert!(reading.held.is_empty());
        // One body alone always goes through, even over the bound.
        assert!(reading.hold(3, &declaring(500), 1000).is_ok());
    }
}
