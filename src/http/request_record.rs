//! The front door's part of the request record (`crate::request_record`): every API
//! request gets one, opened before the route runs and given the response's status and
//! error code when it is ready.

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Request};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;

use crate::contract::{Workload, X_ACS_WORKLOAD};
use crate::error::ErrorBody;
use crate::http::panics;
use crate::request_record::RequestRecord;
use crate::state::AppState;

/// `X-Acs-Workload` when it is one of the two known values; others are ignored.
pub fn workload(headers: &HeaderMap) -> Option<Workload> {
    headers
        .get(X_ACS_WORKLOAD)
        .and_then(|v| v.to_str().ok())
        .and_then(Workload::parse)
}

/// Runs the rest of an API request under its record, opened here and released when the
/// response is ready (a streaming body holds it on); inside the envelope (see
/// `every_request`), so it sees each error's code before the envelope renders it. A
/// panic beneath it is answered (and recorded) as a 500 ([`panics`]).
pub async fn recorded(
    state: &AppState,
    request_id: &str,
    mut request: Request,
    next: Next,
) -> Response {
    // Only API requests are recorded: health probes, metric scrapes and the docs would
    // drown the log (and the request metrics) in noise.
    if !is_api_path(request.uri().path()) {
        return panics::caught(next.run(request)).await;
    }
    let workload = workload(request.headers());
    let client_ip = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip());
    let endpoint = request.uri().path().chars().take(256).collect();
    let record = RequestRecord::open(state, request_id.to_owned(), endpoint, workload, client_ip);
    request.extensions_mut().insert(record.clone());
    let response = panics::caught(next.run(request)).await;
    let error_code = response.extensions().get::<ErrorBody>().map(|e| e.code);
    record.set_outcome(response.status().as_u16(), error_code);
    record.release();
    response
}

fn is_api_path(path: &str) -> bool {
    path.starts_with("/v1/") || path.starts_with("/admin/") || path == "/admin"
}
