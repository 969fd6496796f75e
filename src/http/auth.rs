//! Bearer-key authentication for the `/v1` routes. The key is looked up by its visible
//! prefix in the in-memory key table and its hashes (the current secret's, and during a
//! rotation's grace the previous one's) compared in constant time
//! ([`crate::keys::check`], which also refuses a revoked or expired key); the table
//! follows the store's change feed, so a revocation takes effect at once on the process
//! that made it and within [`crate::keys::FOLLOW_EVERY`] on every other one.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;
use tracing::Instrument;

use crate::error::ApiError;
use crate::key_secret;
use crate::keys::{self, Refusal};
use crate::request_record::RequestRecord;
use crate::state::AppState;
use crate::store::{KeyRecord, now_unix};

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

/// Whether `presented` is the configured admin token (compared in constant time); never
/// when none is configured.
pub fn is_admin_token(state: &AppState, presented: &str) -> bool {
    state
        .config()
        .admin_token
        .as_ref()
        .is_some_and(|token| bool::from(presented.as_bytes().ct_eq(token.expose().as_bytes())))
}

/// Whether the request shows a credential that holds now: an active key the key table
/// has, or the admin token. Never waits for the store (a key too new for the table
/// counts as none) and records nothing: for deciding, before the route runs, whether a
/// client's trace context is followed (`every_request`).
pub fn shows_credential(state: &AppState, headers: &http::HeaderMap) -> bool {
    let Some(token) = bearer_token(headers) else {
        return false;
    };
    if is_admin_token(state, token) {
        return true;
    }
    key_secret::parse_bearer(token).is_some_and(|(prefix, hash)| {
        state
            .keys()
            .get(prefix)
            .is_some_and(|key| keys::check(&key, &hash, now_unix()).is_ok())
    })
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
    let Some((prefix, hash)) = key_secret::parse_bearer(secret) else {
        return Err(ApiError::from(Refusal::Unknown));
    };
    let record = state
        .keys()
        .find(prefix)
        .await
        .map_err(|_| ApiError::StoreUnavailable)?
        .ok_or(ApiError::from(Refusal::Unknown))?;
    keys::check(&record, &hash, now_unix()).map_err(ApiError::from)?;
    Ok(Caller(record))
}
