//! The ops routes, served without a key (and on `ops_listen` too): `GET /metrics`, the
//! Prometheus text of [`Metrics`](crate::metrics::Metrics), and
//! `GET /health`: whether the gateway can serve (its store answers) and, per model,
//! whether any node is up to run requests (no key needed). `?verbose=true` adds each
//! node's state (by its GPU label; node addresses are not published).
//!
//! The status is 503 only when the store does not answer: a model without a node up is
//! reported (`ready: false`, overall `degraded`) but does not take the gateway out of a
//! load balancer, since every replica would see the same nodes.

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::error::ApiError;
use crate::fleet::Model;
use crate::state::AppState;

#[derive(Serialize, ToSchema)]
pub struct Health {
    /// `ok`; `degraded` when a model has no node up or the store does not answer.
    status: &'static str,
    /// Whether the store (keys, ledger) answers.
    store: bool,
    models: Vec<ModelHealth>,
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
        (status = 400, description = "`invalid_request`: `verbose` is not `true` or `false`.", body = crate::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "The store does not answer.", body = Health),
    )
)]
pub async fn health(
    State(state): State<AppState>,
    Query(query): Query<HealthQuery>,
) -> Result<(StatusCode, Json<Health>), ApiError> {
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
    let store = match state.store().ping().await {
        Ok(()) => true,
        Err(err) => {
            tracing::warn!(error = %err, "store health check failed");
            false
        }
    };
    let models: Vec<ModelHealth> = state
        .fleet()
        .models()
        .iter()
        .map(|m| model_health(m, verbose))
        .collect();
    let status = if store && models.iter().all(|m| m.ready) {
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
        Json(Health {
            status,
            store,
            models,
        }),
    ))
}

fn model_health(model: &Model, verbose: bool) -> ModelHealth {
    let nodes_up = model.in_rotation().count();
    ModelHealth {
        id: model.id.clone(),
        ready: nodes_up > 0,
        asleep: model.sleep.is_asleep(),
        nodes_up,
        nodes: model.nodes().len(),
        queued: model.queued(),
        upstreams: verbose.then(|| {
            model
                .nodes()
                .iter()
                .map(|u| NodeHealth {
                    gpu: u.gpu.clone(),
                    up: model.takes_requests(u),
                    in_flight: u.in_flight(),
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
