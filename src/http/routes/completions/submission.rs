//! The HTTP of a job submission (`POST /v1/completions` with `Prefer: respond-async`):
//! the header that makes it idempotent, and the 202 that answers it. The submission
//! itself is `jobs::submit`.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::contract::{IDEMPOTENCY_KEY, PREFERENCE_APPLIED};
use crate::error::ApiError;
use crate::http::routes::job_view::JobView;
use crate::jobs::submit::Submitted;
use crate::state::AppState;

/// The longest `Idempotency-Key` kept.
const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;

/// The job: 202 with the job object when it was stored now, 200 when it was submitted
/// before under the same idempotency key; with `Location` and `Preference-Applied`.
pub fn answer(state: &AppState, submitted: &Submitted) -> Response {
    let Submitted { row, created } = submitted;
    let status = if *created {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
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
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
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

    #[test]
    fn idempotency_keys_are_checked_and_unquoted() {
        let key = |v: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(v).unwrap());
            idempotency_key(&headers)
        };
        assert_eq!(key("\"abc-1\"").unwrap().as_deref(), Some("abc-1"));
        assert_eq!(key("abc-1").unwrap().as_deref(), Some("abc-1"));
        assert!(key("\"\"").is_err());
        assert!(key(&"x".repeat(256)).is_err());
        assert_eq!(idempotency_key(&HeaderMap::new()).unwrap(), None);
    }
}
