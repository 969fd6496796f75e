//! `POST /v1/completions`: parse → plan → forward → relay.

pub mod chat;
pub mod plan;
pub mod relay;
pub mod request;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};

use crate::app::AppState;
use crate::error::ApiError;
use crate::fleet::{Served, Upstream};
use crate::http::body::{read_limited, require_json};
use plan::Planner;
use request::CompletionRequest;

pub const X_UPSTREAM_MODEL: HeaderName = HeaderName::from_static("x-acs-upstream-model");
pub const X_UPSTREAM_GPU: HeaderName = HeaderName::from_static("x-acs-upstream-gpu");

#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "completions",
    request_body(content = crate::openapi::CompletionRequestDoc, content_type = "application/json"),
    responses(
        (status = 200, description = "A text_completion object (JSON), or an SSE stream of them when `stream` is true; passed through verbatim from vLLM.",
            headers(
                ("X-Request-Id" = String, description = "Trace id of this request; also `request_id` in error bodies."),
                ("X-Acs-Upstream-Model" = String, description = "The checkpoint that served the request."),
                ("X-Acs-Upstream-Gpu" = String, description = "The GPU node that served the request."),
            ),
            content(
                (crate::openapi::CompletionResponseDoc = "application/json"),
                (String = "text/event-stream"),
            )),
        (status = 400, description = "Invalid request: `invalid_request`, `model_not_found`, `full_vocab_prompt_too_long`, or `upstream_bad_request` (the model server rejected it, e.g. context length; with `X-Acs-Upstream-Error-Kind`).", body = crate::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`: missing, malformed, unknown or revoked key.", body = crate::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: body over the limit. Carries `X-Should-Retry: false`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(("X-Should-Retry" = String, description = "`false`: a retry cannot succeed."))),
        (status = 502, description = "`upstream_error`: the model server failed. Carries `Retry-After` and `X-Acs-Upstream-Error-Kind`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait before retrying."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "Mirrors `error.code`."),
            )),
        (status = 503, description = "`upstream_unavailable`: no model server could be reached. Carries `Retry-After` and `X-Acs-Upstream-Error-Kind`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait before retrying."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "Mirrors `error.code`."),
            )),
    ),
    security(("bearer" = []))
)]
pub async fn create_completion(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    require_json(&headers)?;
    let bytes = read_limited(&headers, body, state.config().max_body_bytes).await?;
    let request = CompletionRequest::parse(&bytes)?;
    let model = state.fleet().resolve(request.model())?;
    request.check_logprobs_cap(model.max_logprobs)?;

    let upstream = model.pick();
    let served = state.upstream().discover(&upstream).await;
    let tags = upstream_tags(&upstream, served.as_deref().ok());
    let result = match served {
        Ok(served) => forward(&state, &request, &upstream, &served).await,
        Err(err) => Err(err.into()),
    };
    let mut response = result.unwrap_or_else(IntoResponse::into_response);
    response.headers_mut().extend(tags);
    Ok(response)
}

async fn forward(
    state: &AppState,
    request: &CompletionRequest<'_>,
    upstream: &Upstream,
    served: &Served,
) -> Result<Response, ApiError> {
    let client = state.upstream();
    let plan = Planner {
        client,
        upstream,
        served,
    }
    .plan(request)
    .await?;
    let body = request.upstream_body(&served.name, plan.injected_max_tokens);
    let response = client.send_completion(upstream, body.into()).await?;
    relay::relay(response).await
}

/// `X-Acs-Upstream-Model` / `X-Acs-Upstream-Gpu`: which backend served (or failed); the
/// model only once the upstream has said what it serves.
fn upstream_tags(upstream: &Upstream, served: Option<&Served>) -> Vec<(HeaderName, HeaderValue)> {
    let mut tags = Vec::with_capacity(2);
    if let Some(value) = served.and_then(|s| HeaderValue::from_str(&s.name).ok()) {
        tags.push((X_UPSTREAM_MODEL, value));
    }
    if let Ok(value) = HeaderValue::from_str(&upstream.gpu) {
        tags.push((X_UPSTREAM_GPU, value));
    }
    tags
}
