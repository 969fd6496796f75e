//! The ops routes, served without a key (and on `ops_listen` too):
//! - `GET /metrics`: the Prometheus text of [`Metrics`](crate::metrics::Metrics);
//! - `GET /live` (liveness): 200 while the process serves. Nothing outside it is asked,
//!   since restarting the process would not bring a database or Redis back;
//! - `GET /ready` (readiness): 200 when this replica can admit requests — the store and
//!   the live counters (Redis, when configured) answer and it is not shutting down —
//!   else 503 with the reasons, so a load balancer stops sending it traffic;
//! - `GET /health`: the whole picture — store, live counters and, per model, whether any
//!   node is up. `?verbose=true` adds each node's state and why it is down (by its GPU
//!   label; node addresses are not published).
//!
//! A model without a node up is reported (`ready: false`, overall `degraded`) but takes
//! no replica out of a load balancer, since every replica sees the same nodes.

use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::error::ApiError;
use crate::fleet::Model;
use crate::http::every_request::OwnBody;
use crate::state::AppState;

#[derive(Serialize, ToSchema)]
pub struct Health {
    /// `ok`; `degraded` when a model has no node up, or the store or the live counters
    /// do not answer.
    status: &'static str,
    /// Whether the store (keys, ledger) answers.
    store: bool,
    /// Whether the live counters (Redis, when configured) answer; while they do not,
    /// every request is refused with 503 `admission_unavailable`.
    admission: bool,
    models: Vec<ModelHealth>,
}

#[derive(Serialize, ToSchema)]
pub struct Readiness {
    /// Whether this replica can admit requests now.
    ready: bool,
    /// Why not: `store_unavailable`, `admission_unavailable`, `shutting_down`.
    reasons: Vec<&'static str>,
}

#[derive(Serialize, ToSchema)]
pub struct Liveness {
    /// Always `ok`: the process answers.
    status: &'static str,
}

#[derive(Serialize, ToSchema)]
pub struct ModelHealth {
    id: String,
    /// A node is up to take requests now.
    ready: bool,
    /// Put to sleep by the keep-warm policy; the next request wakes it.
    asleep: bool,
    nodes_up: usize,
    nodes: usize,
    /// Requests waiting for a node below its `max_in_flight`.
    queued: u32,
    /// With `verbose=true`: each node.
    #[serde(skip_serializing_if = "Option::is_none")]
    upstreams: Option<Vec<NodeHealth>>,
}

#[derive(Serialize, ToSchema)]
pub struct NodeHealth {
    gpu: String,
    /// `false` while ejected (failed requests or probes) or asleep.
    up: bool,
    /// Why it is down: `request_failed` (a request sent to it failed), `probe_failed`
    /// (it did not answer its health probe) or `asleep`. Absent while up.
    #[serde(skip_serializing_if = "Option::is_none")]
    down_reason: Option<&'static str>,
    in_flight: usize,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct HealthQuery {
    /// `true` adds each node's state.
    verbose: Option<String>,
}

#[utoipa::path(
    get,
    path = "/health",
    tag = "ops",
    params(HealthQuery),
    responses(
        (status = 200, description = "The gateway is serving; each model says whether a node is up.", body = Health),
        (status = 400, description = "`invalid_request`: `verbose` is not `true` or `false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "The store does not answer.", body = Health),
    )
)]
pub async fn health(
    State(state): State<AppState>,
    Query(query): Query<HealthQuery>,
) -> Result<(StatusCode, Extension<OwnBody>, Json<Health>), ApiError> {
    let verbose = match query.verbose.as_deref() {
        None | Some("false" | "0") => false,
        Some("" | "true" | "1") => true,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "verbose",
                format!("verbose must be true or false (got '{other}')"),
            ));
        }
    };
    let (store, admission) = dependencies(&state).await;
    let models: Vec<ModelHealth> = state
        .fleet()
        .models()
        .iter()
        .map(|m| model_health(m, verbose))
        .collect();
    let status = if store && admission && models.iter().all(|m| m.ready) {
        "ok"
    } else {
        "degraded"
    };
    let code = if store {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Ok((
        code,
        Extension(OwnBody),
        Json(Health {
            status,
            store,
            admission,
            models,
        }),
    ))
}

/// Whether the store and the live counters answer, asked at once.
async fn dependencies(state: &AppState) -> (bool, bool) {
    let (store, admission) = tokio::join!(state.store().ping(), state.limiter().ping());
    if let Err(err) = &store {
        tracing::warn!(error = %err, "store health check failed");
    }
    if let Err(err) = &admission {
        tracing::warn!(error = %err, "live counters health check failed");
    }
    (store.is_ok(), admission.is_ok())
}

#[utoipa::path(
    get,
    path = "/ready",
    tag = "ops",
    responses(
        (status = 200, description = "This replica can admit requests.", body = Readiness),
        (status = 503, description = "It cannot: the store or the live counters do not answer, or it is shutting down. `reasons` says which.", body = Readiness),
    )
)]
pub async fn ready(
    State(state): State<AppState>,
) -> (StatusCode, Extension<OwnBody>, Json<Readiness>) {
    let (store, admission) = dependencies(&state).await;
    let reasons: Vec<&'static str> = [
        (!store).then_some("store_unavailable"),
        (!admission).then_some("admission_unavailable"),
        state.draining().is_cancelled().then_some("shutting_down"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let ready = reasons.is_empty();
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Extension(OwnBody), Json(Readiness { ready, reasons }))
}

#[utoipa::path(
    get,
    path = "/live",
    tag = "ops",
    responses((status = 200, description = "The process serves.", body = Liveness))
)]
pub async fn live() -> Json<Liveness> {
    Json(Liveness { status: "ok" })
}

fn model_health(model: &Model, verbose: bool) -> ModelHealth {
    // One snapshot, so that the counts and the list agree across a reload.
    let nodes = model.nodes();
    let nodes_up = nodes.iter().filter(|u| model.takes_requests(u)).count();
    ModelHealth {
        id: model.id.clone(),
        ready: nodes_up > 0,
        asleep: model.sleep.is_asleep(),
        nodes_up,
        nodes: nodes.len(),
        queued: model.queued(),
        upstreams: verbose.then(|| {
            nodes
                .iter()
                .map(|u| {
                    let down_reason = if model.sleep.is_asleep() {
                        Some(crate::fleet::DownReason::Asleep)
                    } else {
                        u.health.down_reason()
                    };
                    NodeHealth {
                        gpu: u.gpu.clone(),
                        up: down_reason.is_none(),
                        down_reason: down_reason.map(crate::fleet::DownReason::as_str),
                        in_flight: u.in_flight(),
                    }
                })
                .collect()
        }),
    }
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<AppState>) -> Response {
    state.metrics().observe_fleet(state.fleet());
    let ledger = state.ledger().stats();
    state.metrics().observe_ledger(ledger.pending, ledger.lost);
    match state.metrics().encode() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                crate::metrics::PROMETHEUS_CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(err) => {
            tracing::error!(error = %err, "could not encode the metrics");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}
