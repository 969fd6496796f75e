//! A request that has not started when the shutdown grace period ends gets 503.

use crate::error::ApiError;
use crate::state::AppState;

/// Runs `work` unless the shutdown grace period ends first (then 503).
pub(super) async fn unless_draining<T>(
    state: &AppState,
    work: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    tokio::select! {
        done = work => done,
        () = state.draining().cancelled() => Err(shutting_down()),
    }
}

/// 503: the shutdown grace period is over and the request had not started.
pub(super) fn shutting_down() -> ApiError {
    ApiError::UpstreamUnavailable("fleetgate is shutting down. Retry shortly.".into())
}
