//! The Workbench's routes count against the key's rate (`requests_per_minute`) as a
//! completion does: listing, reading and saving work takes no node, but is not free,
//! and a key over its rate gets the same `rate_limited` 429 here as on completions. No
//! slot or budget is taken (`admit::count_start`).

use axum::Extension;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::admission::KeyLimits;
use crate::completion::admit;
use crate::error::ApiError;
use crate::http::auth::Caller;
use crate::state::AppState;

/// Beneath `auth::require_key` (which gives the [`Caller`]).
pub async fn count_against_rate(
    State(state): State<AppState>,
    Extension(Caller(key)): Extension<Caller>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let limits = KeyLimits::resolve(&state.config().limits, &key.limits);
    admit::count_start(&state, key.id, &limits).await?;
    Ok(next.run(request).await)
}
