//! How the Workbench API turns what the store says into answers: store failures and
//! versioned outcomes as [`ApiError`]s, stored JSON text back as JSON, titles checked,
//! the key's byte bound.

use axum::http::StatusCode;

use crate::error::ApiError;
use crate::state::AppState;
use crate::store::StoreError;
use crate::store::workbench::{Versioned, WorkbenchStore};

/// Longest title of an item or tree, in characters.
const TITLE_MAX_CHARS: usize = 200;

/// The client-facing error for a store failure: a value the store refuses is the
/// client's (400), as is a write over the key's bytes (413); anything else means the
/// store cannot serve now (503).
pub(super) fn store_error(err: StoreError) -> ApiError {
    match err {
        StoreError::Invalid(message) => ApiError::invalid(message),
        StoreError::QuotaExceeded { bytes, limit } => {
            ApiError::StorageQuotaExceeded { bytes, limit }
        }
        err => ApiError::store_unavailable(&err, "a workbench request"),
    }
}

/// The key's workbench records.
pub(super) fn store(state: &AppState) -> &dyn WorkbenchStore {
    state.store().workbench()
}

/// The bytes one key may keep (`workbench.max_bytes_per_key`, validated to fit).
pub(super) fn max_bytes(state: &AppState) -> i64 {
    i64::try_from(state.config().workbench.max_bytes_per_key).unwrap_or(i64::MAX)
}

/// 404 for the `what` (item, tree, node) with `id`: missing, or another key's.
pub(super) fn not_found(what: &'static str, id: i64) -> ApiError {
    ApiError::WorkbenchNotFound { what, id }
}

/// A title as given, if it is at most [`TITLE_MAX_CHARS`] long.
pub(super) fn checked_title(title: &str) -> Result<&str, ApiError> {
    let chars = title.chars().count();
    if chars > TITLE_MAX_CHARS {
        return Err(ApiError::invalid_param(
            "title",
            format!("title must be at most {TITLE_MAX_CHARS} characters (got {chars})"),
        ));
    }
    Ok(title)
}

/// What the pages store with an item or node: any JSON object.
pub(super) type JsonObject = serde_json::Map<String, serde_json::Value>;

/// An object as stored.
pub(super) fn json_text(object: &JsonObject) -> String {
    // A map of JSON values always serializes.
    serde_json::to_string(object).unwrap_or_default()
}

/// A stored object back as an object (stored only from an object, so it parses).
pub(super) fn stored_object(text: &str) -> JsonObject {
    serde_json::from_str(text).unwrap_or_default()
}

/// [`stored_object`] as a JSON value.
pub(super) fn stored_json(text: &str) -> serde_json::Value {
    serde_json::Value::Object(stored_object(text))
}

/// The changed record, or the error for a missing or stale one.
pub(super) fn versioned<T>(
    outcome: Versioned<T>,
    what: &'static str,
    id: i64,
    given: i64,
) -> Result<T, ApiError> {
    match outcome {
        Versioned::Changed(record) => Ok(record),
        Versioned::Missing => Err(not_found(what, id)),
        Versioned::Stale { current } => Err(ApiError::VersionConflict {
            what,
            id,
            given,
            current,
        }),
    }
}

/// 204 when something was deleted, else 404 for the `what` with `id`.
pub(super) fn deleted(done: bool, what: &'static str, id: i64) -> Result<StatusCode, ApiError> {
    if done {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(not_found(what, id))
    }
}
