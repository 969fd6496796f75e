//! `GET /health`: liveness of the gateway and its store (no key needed).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;

use crate::app::AppState;

#[derive(Serialize, ToSchema)]
pub struct Health {
    /// `ok`, or `degraded` when the store does not answer.
    status: &'static str,
}

#[utoipa::path(
    get,
    path = "/health",
    tag = "ops",
    responses(
        (status = 200, description = "The gateway is serving.", body = Health),
        (status = 503, description = "The store does not answer.", body = Health),
    )
)]
pub async fn health(State(state): State<AppState>) -> (StatusCode, Json<Health>) {
    match state.store().ping().await {
        Ok(()) => (StatusCode::OK, Json(Health { status: "ok" })),
        Err(err) => {
            tracing::warn!(error = %err, "store health check failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(Health { status: "degraded" }),
            )
        }
    }
}
