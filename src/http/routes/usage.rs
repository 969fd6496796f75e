//! A key's budget and limits as they stand: `GET /v1/usage` for the calling key, and the
//! admin API's per-key view.

use serde::Serialize;
use utoipa::ToSchema;

use crate::admission::{KeyLimits, Month};
use crate::error::ApiError;
use crate::http::auth::Caller;
use crate::state::AppState;
use crate::store::{KeyRecord, now_unix};

#[derive(Debug, Serialize, ToSchema)]
pub struct KeyUsage {
    /// The key's visible prefix.
    key_prefix: String,
    /// The budget period, `YYYY-MM` (UTC).
    month: String,
    /// Unix seconds of the next reset (00:00 UTC on the 1st).
    resets_at: i64,
    /// Monthly budget in tokens (prompt + completion): the `monthly_budget` of the key's
    /// limits.
    monthly_budget: u64,
    /// The same as `monthly_budget`, under its first name; kept for existing clients.
    #[schema(deprecated)]
    budget: u64,
    /// Tokens used by finished requests this month.
    used: u64,
    /// Tokens reserved by running requests (their worst case).
    reserved: u64,
    /// `monthly_budget − used − reserved`.
    remaining: u64,
    requests_per_minute: u32,
    max_concurrent: u32,
    max_queued: u32,
    /// The key's weight in its models' fleet queues: while a model's nodes are all busy,
    /// keys with work waiting get node slots in proportion to their share, counted in
    /// tokens.
    share: u32,
    /// Requests of this key running now.
    running: u32,
    /// Requests of this key waiting now.
    queued: u32,
    /// Unix seconds from which the key is refused; null: it does not expire.
    expires_at: Option<i64>,
    /// While a rotation's grace lasts, Unix seconds from which the key's previous
    /// secret (the one the rotation replaced) is refused; null when no previous secret
    /// works.
    previous_secret_expires_at: Option<i64>,
}

#[utoipa::path(
    get,
    path = "/v1/usage",
    tag = "usage",
    responses(
        (status = 200, description = "The calling key's budget, usage and limits for the current month.", body = KeyUsage),
        (status = 401, description = "`invalid_api_key`: no such key, a revoked or expired one (the message says which, with the time it expired), or a rotated key's previous secret after its grace.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`admission_unavailable`: the live counters cannot be read; or `store_unavailable`: the key is not among the keys this server holds in memory and the store cannot be reached to look it up. Both carry `Retry-After`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = []))
)]
pub async fn own_usage(
    axum::extract::State(state): axum::extract::State<AppState>,
    axum::Extension(caller): axum::Extension<Caller>,
) -> Result<axum::Json<KeyUsage>, ApiError> {
    let key = &caller.0;
    let limits = KeyLimits::resolve(&state.config().limits, &key.limits);
    key_usage(&state, key, &limits).await.map(axum::Json)
}

/// The live view of one key.
pub async fn key_usage(
    state: &AppState,
    key: &KeyRecord,
    limits: &KeyLimits,
) -> Result<KeyUsage, ApiError> {
    let month = Month::now();
    let limiter = state.limiter();
    let unavailable = |_| ApiError::AdmissionUnavailable;
    let usage = limiter.usage(key.id, month).await.map_err(unavailable)?;
    let (running, queued) = limiter.occupancy(key.id).await.map_err(unavailable)?;
    Ok(KeyUsage {
        key_prefix: key.prefix.clone(),
        month: month.to_string(),
        resets_at: month.next_start_unix(),
        monthly_budget: limits.monthly_budget,
        budget: limits.monthly_budget,
        used: usage.used,
        reserved: usage.reserved,
        remaining: limits
            .monthly_budget
            .saturating_sub(usage.used.saturating_add(usage.reserved)),
        requests_per_minute: limits.requests_per_minute,
        max_concurrent: limits.max_concurrent,
        max_queued: limits.max_queued,
        share: limits.share,
        running,
        queued,
        expires_at: key.expires_at,
        previous_secret_expires_at: key.previous_secret_expires_at(now_unix()),
    })
}
