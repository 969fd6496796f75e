//! `POST /v1/completions`: parse → plan → forward → relay.

pub mod admit;
pub mod chat;
pub mod meter;
pub mod plan;
pub mod relay;
pub mod request;
pub mod settle;

use std::time::Instant;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};

use crate::admission::KeyLimits;
use crate::app::AppState;
use crate::error::ApiError;
use crate::fleet::{Model, Served, Upstream};
use crate::http::auth::Caller;
use crate::http::body::{read_limited, require_json};
use crate::http::envelope::RequestId;
use crate::http::request_record::RequestRecord;
use crate::metrics::UpstreamOutcome;
use plan::Planner;
use request::CompletionRequest;
use settle::Settlement;

pub const X_UPSTREAM_MODEL: HeaderName = HeaderName::from_static("x-acs-upstream-model");
pub const X_UPSTREAM_GPU: HeaderName = HeaderName::from_static("x-acs-upstream-gpu");
pub const X_MAX_TOKENS_CLAMPED: HeaderName = HeaderName::from_static("x-acs-max-tokens-clamped");

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
                ("X-Acs-Max-Tokens-Clamped" = String, description = "Present when max_tokens was reduced to fit the key's budget: `requested=N,applied=M,reason=budget,source=client|default` (`default`: you omitted max_tokens and N is the injected default)."),
            ),
            content(
                (crate::openapi::CompletionResponseDoc = "application/json"),
                (String = "text/event-stream"),
            )),
        (status = 400, description = "Invalid request: `invalid_request`, `model_not_found`, `full_vocab_prompt_too_long`, or `upstream_bad_request` (the model server rejected it, e.g. context length; with `X-Acs-Upstream-Error-Kind`).", body = crate::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`: missing, malformed, unknown or revoked key.", body = crate::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: body over the limit. Carries `X-Should-Retry: false`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(("X-Should-Retry" = String, description = "`false`: a retry cannot succeed."))),
        (status = 429, description = "`rate_limited` (more starts per minute than the key's rate), `queue_full` (the key's running and waiting requests are at their limits) or `budget_exceeded` (the monthly token budget is used up; also `X-Should-Retry: false`). Always with `Retry-After`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait; for `budget_exceeded`, until the budget resets."),
                ("X-Should-Retry" = String, description = "`false` on `budget_exceeded`."),
            )),
        (status = 502, description = "`upstream_error`: the model server failed. Carries `Retry-After` and `X-Acs-Upstream-Error-Kind`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait before retrying."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "Mirrors `error.code`."),
            )),
        (status = 503, description = "`upstream_unavailable`: no model server could be reached (with `X-Acs-Upstream-Error-Kind`); or `admission_unavailable`: the shared limit counters cannot be reached, so nothing may start. Both carry `Retry-After`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait before retrying."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "Mirrors `error.code`."),
            )),
    ),
    security(("bearer" = []))
)]
pub async fn create_completion(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Extension(request_id): Extension<RequestId>,
    Extension(record): Extension<RequestRecord>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    require_json(&headers)?;
    let bytes = read_limited(&headers, body, state.config().max_body_bytes).await?;
    let request = CompletionRequest::parse(&bytes)?;
    let model = state.fleet().resolve(request.model())?;
    record.set_model(&model.id);
    request.check_logprobs_cap(model.max_logprobs)?;

    // Any node of the model can say what it serves and count tokens; the node that runs
    // the request is picked only once it is admitted (see `forward`).
    let probe = model.pick();
    let served = state.upstream().discover(&probe).await;
    let tags = upstream_tags(&probe, served.as_deref().ok());
    let result = match served {
        Ok(served) => {
            let target = Target {
                model,
                probe: &probe,
                served: &served,
            };
            forward(&state, &caller, &request_id.0, record, &request, target).await
        }
        Err(err) => Err(err.into()),
    };
    let mut response = result.unwrap_or_else(IntoResponse::into_response);
    for (name, value) in tags {
        // `forward` names the node that ran the request; the probe only stands in when
        // the request failed before one was picked.
        response.headers_mut().entry(name).or_insert(value);
    }
    Ok(response)
}

/// The model a request runs on and what it serves.
#[derive(Clone, Copy)]
struct Target<'a> {
    model: &'a Model,
    /// The node asked for the model's facts and token counts.
    probe: &'a Upstream,
    served: &'a Served,
}

/// plan → admit → forward → relay.
async fn forward(
    state: &AppState,
    caller: &Caller,
    request_id: &str,
    record: RequestRecord,
    request: &CompletionRequest<'_>,
    target: Target<'_>,
) -> Result<Response, ApiError> {
    let client = state.upstream();
    let plan = Planner {
        client,
        upstream: target.probe,
        served: target.served,
    }
    .plan(request)
    .await?;
    let limits = KeyLimits::resolve(&state.config().limits, &caller.limits);
    let grant = admit::admit(state, caller.key_id, &limits, &plan.cost, request_id).await?;
    let mut settlement = Settlement::new(
        state.clone(),
        caller.key_id,
        request_id.to_owned(),
        grant,
        plan.cost.prompt_tokens,
        record,
    );
    let applied = settlement.grant().max_tokens;
    let clamped = applied < plan.cost.max_tokens;
    let send_max_tokens = (clamped || plan.default_max_tokens).then_some(applied);
    let body = request.upstream_body(&target.served.name, send_max_tokens);
    // Picked and counted in flight in one step, so concurrent picks see each other.
    let upstream = target.model.pick();
    settlement.hold_in_flight(
        upstream.start(),
        state
            .metrics()
            .upstream(&target.model.id, &upstream.gpu)
            .in_flight(),
    );
    let sent = send(state, request, &upstream, target, body, settlement).await;
    let mut response = sent.unwrap_or_else(IntoResponse::into_response);
    let headers = response.headers_mut();
    if let Ok(gpu) = HeaderValue::from_str(&upstream.gpu) {
        headers.insert(X_UPSTREAM_GPU, gpu);
    }
    if clamped {
        let source = if plan.default_max_tokens {
            "default"
        } else {
            "client"
        };
        let value = format!(
            "requested={},applied={applied},reason=budget,source={source}",
            plan.cost.max_tokens
        );
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(X_MAX_TOKENS_CLAMPED, value);
        }
    }
    Ok(response)
}

/// Sends the request to the chosen node and relays its answer.
async fn send(
    state: &AppState,
    request: &CompletionRequest<'_>,
    upstream: &Upstream,
    target: Target<'_>,
    body: Vec<u8>,
    settlement: Settlement,
) -> Result<Response, ApiError> {
    let metrics = state.metrics().upstream(&target.model.id, &upstream.gpu);
    let sent = Instant::now();
    let response = match state
        .upstream()
        .send_completion(upstream, body.into())
        .await
    {
        Ok(response) => response,
        Err(err) => {
            metrics.outcome(UpstreamOutcome::Unreachable);
            settlement.release_unused().await;
            return Err(err.into());
        }
    };
    let first_byte = relay::FirstByte { metrics, sent };
    relay::relay(
        response,
        settlement,
        request.include_usage(),
        first_byte,
        state.draining().clone(),
    )
    .await
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
