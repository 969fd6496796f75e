//! Bearer-key authentication for the `/v1` routes. The key is looked up by its visible
//! prefix and its hash compared in constant time. Keys are read from the store on every
//! request, so a revocation (from the CLI or another replica) takes effect at once.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use crate::error::ApiError;
use crate::http::request_record::RequestRecord;
use crate::keys;
use crate::state::AppState;
use crate::store::LimitOverrides;

/// The authenticated caller, available to handlers as an extension.
#[derive(Debug, Clone)]
pub struct Caller {
    pub key_id: i64,
    pub key_prefix: String,
    pub email: Option<String>,
    /// The key's own limits over the configured defaults.
    pub limits: LimitOverrides,
}

pub async fn require_key(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let caller = authenticate(&state, request.headers()).await?;
    tracing::Span::current().record("key_prefix", caller.key_prefix.as_str());
    if let Some(record) = request.extensions().get::<RequestRecord>() {
        record.set_caller(caller.key_id, &caller.key_prefix, caller.email.as_deref());
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
    let Some((prefix, hash)) = keys::parse_bearer(secret) else {
        return Err(invalid);
    };
    let record = state
        .store()
        .key_by_prefix(prefix)
        .await
        .map_err(ApiError::internal)?;
    match record {
        Some(record) if keys::verify(&record.hash, &hash) => {
            if !record.is_active() {
                return Err(ApiError::Unauthorized("This API key has been revoked."));
            }
            Ok(Caller {
                key_id: record.id,
                key_prefix: record.prefix,
                email: record.email,
                limits: record.limits,
            })
        }
        _ => Err(invalid),
    }
}
