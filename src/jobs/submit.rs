//! Submitting a completion job: `POST /v1/completions` with `Prefer: respond-async`.
//!
//! The request is checked and admitted exactly as a synchronous one would be (every
//! 400/401/413/429 is answered here, and the submission counts as a start against the
//! key's rate), then stored and answered `202 Accepted` with `Location:
//! /v1/harvest/{id}`. Its run is admitted again when a worker takes it (slots and
//! budget, as any request). With an `Idempotency-Key`, a retry with the same body gets
//! the job already submitted (200) and one with another body 422, before any admission.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::time::Duration;

use super::view::JobView;
use crate::completion::pipeline::{self, Checked};
use crate::contract::{IDEMPOTENCY_KEY, PREFER, PREFERENCE_APPLIED};
use crate::error::ApiError;
use crate::http::auth::Caller;
use crate::state::AppState;
use crate::store::{Inserted, JobRow, NewJob, now_unix_ms};

/// The longest `Idempotency-Key` kept.
const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;
/// Suggested wait after the key's pending jobs reached their bound.
const PENDING_RETRY_AFTER: Duration = Duration::from_secs(5);

/// Whether any `Prefer` header asks for `respond-async` (RFC 7240: a comma-separated
/// list of preferences, each a token with optional `=value` and `;` parameters).
pub fn prefers_async(headers: &HeaderMap) -> bool {
    headers
        .get_all(PREFER)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|preference| {
            let name = preference.split([';', '=']).next().unwrap_or("").trim();
            name.eq_ignore_ascii_case("respond-async")
        })
}

/// Stores the checked request as a job of the caller's key.
pub async fn submit(
    state: &AppState,
    caller: &Caller,
    request_id: &str,
    headers: &HeaderMap,
    body: &[u8],
    checked: Checked<'_, '_>,
) -> Result<Response, ApiError> {
    if checked.request.stream() {
        return Err(ApiError::invalid_param(
            "stream",
            "A job's result is one JSON body: leave stream out (or false) with Prefer: respond-async.",
        ));
    }
    let idempotency_key = idempotency_key(headers)?;
    let request_hash = Sha256::digest(body).to_vec();
    let key = caller.0.id;
    let jobs = state.store().jobs();
    let unavailable =
        |err: crate::store::StoreError| ApiError::store_unavailable(&err, "a job submission");
    if let Some(ikey) = &idempotency_key
        && let Some(existing) = jobs
            .by_idempotency_key(key, ikey)
            .await
            .map_err(unavailable)?
    {
        return repeated(state, &existing, &request_hash, ikey);
    }
    let settings = &state.config().jobs;
    let pending = jobs.pending(key).await.map_err(unavailable)?;
    if pending >= u64::from(settings.max_pending_per_key) {
        return Err(ApiError::JobsPending {
            pending,
            retry_after: PENDING_RETRY_AFTER,
        });
    }
    let window = Some(Duration::from_millis(settings.run_timeout_ms));
    pipeline::admissible(state, caller, request_id, &checked, window).await?;
    let now_ms = now_unix_ms();
    let job = NewJob {
        id: format!("job_{}", uuid::Uuid::now_v7().simple()),
        key_id: key,
        model: checked.model.id.clone(),
        idempotency_key: idempotency_key.clone(),
        request_hash: request_hash.clone(),
        request: body.to_vec(),
        created_at_ms: now_ms,
        expires_at_ms: now_ms
            .saturating_add(i64::try_from(settings.queued_ttl_ms).unwrap_or(i64::MAX)),
    };
    match jobs.insert(&job).await.map_err(unavailable)? {
        Inserted::Created(row) => {
            state.jobs().job_queued();
            tracing::info!(job_id = %row.id, request_id, model = %row.model, "job submitted");
            Ok(answer(state, StatusCode::ACCEPTED, &row))
        }
        // The same key's concurrent submission under this idempotency key won.
        Inserted::Existing(row) => repeated(
            state,
            &row,
            &request_hash,
            idempotency_key.as_deref().unwrap_or(""),
        ),
    }
}

/// The answer to a submission whose idempotency key is taken: the job when the body is
/// the same, else 422.
fn repeated(
    state: &AppState,
    existing: &JobRow,
    request_hash: &[u8],
    idempotency_key: &str,
) -> Result<Response, ApiError> {
    if existing.request_hash != request_hash {
        return Err(ApiError::IdempotencyKeyReused(idempotency_key.to_owned()));
    }
    Ok(answer(state, StatusCode::OK, existing))
}

/// The job object with `Location` and `Preference-Applied`.
fn answer(state: &AppState, status: StatusCode, row: &JobRow) -> Response {
    let view = JobView::of(row, &state.config().jobs);
    let mut response = (status, axum::Json(view)).into_response();
    let headers = response.headers_mut();
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/harvest/{}", row.id)) {
        headers.insert(header::LOCATION, location);
    }
    headers.insert(
        PREFERENCE_APPLIED,
        HeaderValue::from_static("respond-async"),
    );
    response
}

/// The `Idempotency-Key` header: a string of visible ASCII, optionally quoted (the
/// draft makes it a structured-field string), of at most 255 bytes.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    let invalid = || {
        ApiError::invalid_param(
            "Idempotency-Key",
            format!(
                "The Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY_BYTES} visible ASCII characters (optionally in double quotes)."
            ),
        )
    };
    let text = value.to_str().map_err(|_| invalid())?.trim();
    let text = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(text);
    let visible = text.bytes().all(|b| b.is_ascii_graphic() || b == b' ');
    if text.is_empty() || text.len() > MAX_IDEMPOTENCY_KEY_BYTES || !visible {
        return Err(invalid());
    }
    Ok(Some(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    #[test]
    fn respond_async_is_found_among_other_preferences() {
        assert!(prefers_async(&headers(&[("prefer", "respond-async")])));
        assert!(prefers_async(&headers(&[(
            "prefer",
            "return=minimal, Respond-Async; wait=10"
        )])));
        assert!(prefers_async(&headers(&[
            ("prefer", "wait=5"),
            ("prefer", "respond-async")
        ])));
        assert!(!prefers_async(&headers(&[(
            "prefer",
            "respond-asynchronously"
        )])));
        assert!(!prefers_async(&headers(&[])));
    }

    #[test]
    fn idempotency_keys_are_checked_and_unquoted() {
        let key = |v: &str| idempotency_key(&headers(&[("idempotency-key", v)]));
        assert_eq!(key("\"abc-1\"").unwrap().as_deref(), Some("abc-1"));
        assert_eq!(key("abc-1").unwrap().as_deref(), Some("abc-1"));
        assert!(key("\"\"").is_err());
        assert!(key(&"x".repeat(256)).is_err());
        assert_eq!(idempotency_key(&HeaderMap::new()).unwrap(), None);
    }
}
