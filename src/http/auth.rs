//! Bearer-key authentication for the `/v1` routes. The key is looked up by its visible
//! prefix in the in-memory key table and its hash compared in constant time; the table
//! follows the store's change feed, so a revocation takes effect at once on the process
//! that made it and within [`crate::keys::FOLLOW_EVERY`] on every other one.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use crate::error::ApiError;
use crate::key_secret;
use crate::request_record::RequestRecord;
use crate::state::AppState;
use crate::store::KeyRecord;

/// The authenticated caller, available to handlers as an extension: its key's record
/// (id, prefix, e-mail, its own limits over the configured defaults) as the key table
/// had it when the request arrived.
#[derive(Debug, Clone)]
pub struct Caller(pub Arc<KeyRecord>);

pub async fn require_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let caller = authenticate(&state, request.headers())
        .instrument(tracing::debug_span!("auth"))
        .await?;
    let key = &caller.0;
    tracing::Span::current().record("key_prefix", key.prefix.as_str());
    if let Some(record) = request.extensions().get::<RequestRecord>() {
        record.set_caller(key.id, &key.prefix, key.email.as_deref());
    }
    request.extensions_mut().insert(caller);
    Ok(next.run(request).await)
}

/// The token of an `Authorization: Bearer <token>` header (scheme case-insensitive).
pub fn bearer_token(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .trim()
        .split_once(' ')
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
}

async fn authenticate(state: &AppState, headers: &http::HeaderMap) -> Result<Caller, ApiError> {
    if !headers.contains_key(header::AUTHORIZATION) {
        return Err(ApiError::Unauthorized(
            "Missing Authorization header. Send 'Authorization: Bearer <your key>'.",
        ));
    }
    let secret = bearer_token(headers).ok_or(ApiError::Unauthorized(
        "The Authorization header must be 'Bearer <your key>'.",
    ))?;
    let invalid = ApiError::Unauthorized("Invalid API key.");
    let Some((prefix, hash)) = key_secret::parse_bearer(secret) else {
        return Err(invalid);
    };
    let record = state
        .keys()
        .find(prefix)
        .await
        .map_err(|_| ApiError::StoreUnavailable)?;
    match record {
        Some(record) if key_secret::verify(&record.hash, &hash) => {
            if !record.is_active() {
                return Err(ApiError::Unauthorized("This API key has been revoked."));
            }
            Ok(Caller(record))
        }
        _ => Err(invalid),
    }
}
