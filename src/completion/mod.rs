//! `POST /v1/completions`: parse → plan → forward → relay.

pub mod admit;
pub mod budget_refusal;
pub mod chat;
pub mod cold;
pub mod dispatch;
mod draining;
mod job;
pub mod meter;
pub mod plan;
pub mod relay;
pub mod request;
pub mod settle;

use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::admission::KeyLimits;
use crate::contract::{X_ACS_MAX_TOKENS_CLAMPED, X_ACS_UPSTREAM_GPU, X_ACS_UPSTREAM_MODEL};
use crate::error::ApiError;
use crate::fleet::{Model, NoNode, Node};
use crate::http::auth::Caller;
use crate::http::body::{read_limited, require_json};
use crate::http::envelope::RequestId;
use crate::http::request_record::{RequestRecord, workload};
use crate::state::AppState;
use crate::upstream::Served;
use budget_refusal::OnBudgetClamp;
use dispatch::Window;
use draining::unless_draining;
use job::Job;
use plan::{DeadlineFit, Plan, PlanError, Planner};
use request::CompletionRequest;
use settle::Settlement;

#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "completions",
    request_body(content = crate::openapi::CompletionRequestDoc, content_type = "application/json"),
    params(
        ("X-Acs-Budget-Clamp" = Option<String>, Header, description = "`clamp` (default): where the key's budget cannot cover `max_tokens`, run with fewer (`X-Acs-Max-Tokens-Clamped` says so); `refuse`: answer 429 `budget_exceeded` instead, naming what is left and what the request needs (the Workbench and Loom send this). Another value is 400 `invalid_request`."),
    ),
    responses(
        (status = 200, description = "A text_completion object (JSON), or an SSE stream of them when `stream` is true; passed through verbatim from vLLM. After a confirmed cold boot of a sleeping model, the 200 is sent at once and the connection kept alive (`: booting` SSE comment lines, or leading spaces before the JSON) until the answer flows; an error after that point arrives in the body as the error envelope (JSON), or as an SSE `data:` event with the envelope followed by `data: [DONE]`, without `X-Acs-Upstream-Error-Kind`.",
            headers(
                ("X-Request-Id" = String, description = "Trace id of this request; also `request_id` in error bodies."),
                ("X-Acs-Upstream-Model" = String, description = "The checkpoint that served the request."),
                ("X-Acs-Upstream-Gpu" = String, description = "The GPU node that served the request."),
                ("X-Acs-Max-Tokens-Clamped" = String, description = "Present when max_tokens was reduced: `requested=N,applied=M,reason=budget|deadline|deadline+budget,source=client|default`. `budget`: to fit the key's budget; `deadline`: you omitted max_tokens on a non-streaming request and the default was cut to what can finish inside the request window (send stream=true to keep the full default); `default`: N is the injected default."),
            ),
            content(
                (crate::openapi::CompletionResponseDoc = "application/json"),
                (crate::openapi::CompletionStreamEventDoc = "text/event-stream"),
            )),
        (status = 400, description = "Invalid request: `invalid_request`, `model_not_found`, `full_vocab_prompt_too_long`, `deadline_infeasible` (a non-streaming request whose max_tokens cannot finish inside the request window; with `X-Should-Retry: false` — send stream=true), or `upstream_bad_request` (the model server rejected it, e.g. context length; with `X-Acs-Upstream-Error-Kind`).", body = crate::openapi::ErrorEnvelopeDoc,
            headers(("X-Should-Retry" = String, description = "`false` on `deadline_infeasible`."))),
        (status = 401, description = "`invalid_api_key`: missing, malformed, unknown or revoked key.", body = crate::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: body over the limit. Carries `X-Should-Retry: false`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(("X-Should-Retry" = String, description = "`false`: a retry cannot succeed."))),
        (status = 429, description = "`rate_limited` (more starts per minute than the key's rate), `queue_full` (the key's running and waiting requests are at their limits) or `budget_exceeded` (what is left of the monthly token budget is less than the request needs, or than its full `max_tokens` with `X-Acs-Budget-Clamp: refuse`; also `X-Should-Retry: false`). Always with `Retry-After`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait; for `budget_exceeded`, until the budget resets."),
                ("X-Should-Retry" = String, description = "`false` on `budget_exceeded`."),
            )),
        (status = 502, description = "`upstream_error`: the model server failed (a 5xx, or it stopped answering mid-request). A request that provably never started on a node (connection refused or reset before any response, or a 503) is retried once on another node before this is returned. Carries `Retry-After` and `X-Acs-Upstream-Error-Kind`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait before retrying."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "Mirrors `error.code`."),
            )),
        (status = 503, description = "`upstream_unavailable`: no node of the model is up or reachable, a sleeping model could not be woken, or every node is at capacity and the fleet queue is full or timed out (with `X-Acs-Upstream-Error-Kind`); or `admission_unavailable`: the shared limit counters cannot be reached, so nothing may start; or `store_unavailable`: the key is not among the keys this server holds in memory and the store cannot be reached to look it up, or the store has been away so long that the usage waiting to be recorded reached its bound. All carry `Retry-After`.", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait before retrying."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "Mirrors `error.code`."),
            )),
        (status = 504, description = "`upstream_deadline`: the model server did not finish a non-streaming request inside the request window; the generation was stopped. `X-Should-Retry: false` and no `Retry-After`: the same request would time out again (send stream=true or lower max_tokens).", body = crate::openapi::ErrorEnvelopeDoc,
            headers(
                ("X-Should-Retry" = String, description = "`false`."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "`upstream_deadline`."),
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
    let on_clamp = OnBudgetClamp::from_headers(&headers)?;
    let config = state.config();
    let body_timeout = Duration::from_millis(config.connections.body_read_timeout_ms);
    // Reading the body is part of parsing it: a slow upload shows here.
    let parse = tracing::debug_span!("parse");
    let bytes = read_limited(&headers, body, config.max_body_bytes, body_timeout)
        .instrument(parse.clone())
        .await?;
    let (request, model) = parse.in_scope(|| {
        let request = CompletionRequest::parse(&bytes).inspect_err(|_| {
            // Count a refused request under its model when it names a known one (unknown
            // names are not metric labels: any string could be sent).
            if let Some(model) =
                named_model(&bytes).and_then(|id| state.fleet().resolve(Some(&id)).ok())
            {
                record.set_model(&model.id);
            }
        })?;
        let model = state.fleet().resolve(request.model())?;
        record.set_model(&model.id);
        request.check_logprobs_cap(model.max_logprobs)?;
        Ok::<_, ApiError>((request, model))
    })?;
    drop(parse); // its span ends with the checks
    if config.traces.enabled() {
        // For the trace only (see `router::trace_span`).
        tracing::Span::current().record("model", model.id.as_str());
    }
    model.sleep.touch(workload(&headers) == Some("interactive"));

    let facts = Facts::learn(&state, model).await?;
    let tags = upstream_tags(facts.node.as_deref(), Some(&facts.served));
    let result = forward(
        &state,
        &caller,
        &request_id.0,
        record,
        (&request, on_clamp),
        model,
        facts,
    )
    .await;
    // `forward` names the node that ran the request; the one asked for the model's facts
    // stands in only when that node failed it (counting tokens). The gateway's own
    // refusals (limits, budget, admission, store) name no node: nothing went upstream.
    let node_failed = result.as_ref().err().is_none_or(ApiError::from_upstream);
    let mut response = result.unwrap_or_else(IntoResponse::into_response);
    for (name, value) in tags {
        if name == X_ACS_UPSTREAM_GPU && !node_failed {
            continue;
        }
        response.headers_mut().entry(name).or_insert(value);
    }
    Ok(response)
}

/// The `model` a body names, if it is a JSON object with a string `model`, whatever
/// else in it is wrong.
fn named_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<String>,
    }
    serde_json::from_slice::<Named>(body).ok()?.model
}

/// What a model serves, and a node that is up to count tokens with (none while the
/// model boots).
struct Facts {
    node: Option<Arc<Node>>,
    served: Arc<Served>,
}

impl Facts {
    /// Asks a node that is up (any node of the model can say what it serves and count
    /// tokens; the node that runs the request is picked once it is admitted). When none
    /// is up and the model has a wake hook: if its checkpoint is known from before,
    /// planning goes on without a node (the wake follows admission); if not, the model
    /// is woken and the request waits for the boot here, before anything is sent to
    /// the client.
    async fn learn(state: &AppState, model: &Model) -> Result<Self, ApiError> {
        if let Some(facts) = Self::ask_nodes(state, model).await? {
            return Ok(facts);
        }
        if !model.sleep.can_wake() {
            return Err(NoNode::NoneUp.into_error(&model.id));
        }
        // Known from before: plan and admit first, and wake only a request that may run
        // (`forward`), so a refused request never boots a GPU.
        if let Some(served) = model.served() {
            return Ok(Self { node: None, served });
        }
        Self::after_boot(state, model).await
    }

    /// Wakes the model (or joins its boot), waits for a node to come up — nothing has
    /// been sent to the client yet — then asks it.
    async fn after_boot(state: &AppState, model: &Model) -> Result<Self, ApiError> {
        unless_draining(state, async {
            model.wake(state.upstream()).await?;
            cold::wait_booted(model).await
        })
        .await?;
        Self::ask_nodes(state, model)
            .await?
            .ok_or_else(|| NoNode::NoneUp.into_error(&model.id))
    }

    /// `Ok(None)` when no node is up; a node that fails to answer is ejected and the
    /// next one asked.
    async fn ask_nodes(state: &AppState, model: &Model) -> Result<Option<Self>, ApiError> {
        let mut last_error = None;
        for _ in 0..model.node_count() {
            let Some(node) = model.any_up() else { break };
            match node.discover(state.upstream()).await {
                Ok(served) => {
                    return Ok(Some(Self {
                        node: Some(node),
                        served,
                    }));
                }
                Err(err) => {
                    dispatch::eject(state, model, &node);
                    last_error = Some(err);
                }
            }
        }
        match last_error {
            Some(err) if !model.sleep.can_wake() => Err(err.into()),
            _ => Ok(None),
        }
    }
}

/// plan → admit → dispatch → relay; `on_clamp` says whether a budget clamp runs or is
/// refused.
async fn forward(
    state: &AppState,
    caller: &Caller,
    request_id: &str,
    record: RequestRecord,
    (request, on_clamp): (&CompletionRequest<'_>, OnBudgetClamp),
    model: &Model,
    mut facts: Facts,
) -> Result<Response, ApiError> {
    let window =
        (!request.stream()).then(|| Duration::from_millis(state.config().fleet.request_window_ms));
    // Each node found dead while counting tokens is replaced once by another.
    let mut attempts = model.node_count() + 1;
    let plan = async {
        loop {
            let planner = Planner {
                client: state.upstream(),
                upstream: facts.node.as_deref(),
                served: &facts.served,
                deadline: window.map(|w| DeadlineFit::new(w, model.decode_tokens_per_second)),
            };
            let lost = facts.node.as_ref().map(|node| node.lost());
            let planned = tokio::select! {
                planned = planner.plan(request) => planned,
                () = cancelled(lost.as_ref()) => Err(PlanError::NodeLost),
            };
            match planned {
                Ok(plan) => return Ok(plan),
                Err(PlanError::Refused(err)) => return Err(err),
                // Counting needs the booting model's tokenizer: nothing has been sent to
                // the client yet, so wait for the boot here.
                Err(PlanError::NoNodeToCount) => facts = Facts::after_boot(state, model).await?,
                Err(PlanError::NodeLost) if attempts > 1 => {
                    attempts -= 1;
                    facts = Facts::learn(state, model).await?;
                }
                Err(PlanError::NodeLost) => return Err(dispatch::stopped_answering()),
            }
        }
    }
    .instrument(tracing::debug_span!("plan"))
    .await?;
    if state.ledger().backlogged() {
        // The store has been away long enough that usage waiting to be recorded reached
        // its bound: refuse rather than run requests whose usage could not be kept.
        return Err(ApiError::StoreUnavailable);
    }
    let key = &caller.0;
    let limits = KeyLimits::resolve(&state.config().limits, &key.limits);
    let grant = admit::admit(state, key.id, &limits, &plan.cost, request_id)
        .instrument(tracing::debug_span!("admit"))
        .await?;
    let settlement = Settlement::new(
        state.clone(),
        key.id,
        request_id.to_owned(),
        grant,
        plan.cost.prompt_tokens,
        record,
    );
    let applied = settlement.grant().max_tokens;
    let budget_clamped = applied < plan.cost.max_tokens;
    if budget_clamped && on_clamp == OnBudgetClamp::Refuse {
        let grant = settlement.grant().clone();
        settlement.release_unused().await;
        return Err(budget_refusal::refusal(state, key.id, &limits, &plan.cost, &grant).await);
    }
    let send_max_tokens = (budget_clamped || plan.default_max_tokens).then_some(applied);
    let body = Bytes::from(request.upstream_body(&facts.served.name, send_max_tokens));
    let clamp = clamp_header(&plan, applied, budget_clamped);
    let affinity = model.affinity(request.prompt().start());
    if model.sleep.can_wake() && !model.is_up() {
        // Wake it (or join the boot under way), then commit a 200 and keep the client
        // company while it boots.
        if let Err(err) = unless_draining(state, model.wake(state.upstream())).await {
            settlement.release_unused().await;
            return Err(err);
        }
        let pending = cold::Pending {
            state: state.clone(),
            model_id: model.id.clone(),
            body,
            affinity,
            include_usage: request.include_usage(),
            stream: request.stream(),
            window: Window(window),
        };
        let mut response = cold::respond(pending, settlement, request_id.to_owned());
        if let Some(clamp) = clamp {
            response
                .headers_mut()
                .insert(X_ACS_MAX_TOKENS_CLAMPED, clamp);
        }
        return Ok(response);
    }
    let job = Job {
        state,
        model,
        include_usage: request.include_usage(),
        body,
        affinity,
        window: Window(window),
    };
    let (result, upstream) = job.run(settlement).await;
    let mut response = result.unwrap_or_else(IntoResponse::into_response);
    let headers = response.headers_mut();
    if let Some(gpu) = upstream.and_then(|u| HeaderValue::from_str(&u.gpu).ok()) {
        headers.insert(X_ACS_UPSTREAM_GPU, gpu);
    }
    if let Some(clamp) = clamp {
        headers.insert(X_ACS_MAX_TOKENS_CLAMPED, clamp);
    }
    Ok(response)
}

/// Resolves when `token` is cancelled; never without one.
async fn cancelled(token: Option<&CancellationToken>) {
    match token {
        Some(token) => token.cancelled().await,
        None => std::future::pending().await,
    }
}

/// `X-Acs-Max-Tokens-Clamped` when the request window or the budget cut `max_tokens`.
fn clamp_header(plan: &Plan, applied: u64, budget_clamped: bool) -> Option<HeaderValue> {
    let reason = match (plan.deadline_clamped, budget_clamped) {
        (false, false) => return None,
        (true, false) => "deadline",
        (false, true) => "budget",
        (true, true) => "deadline+budget",
    };
    let source = if plan.default_max_tokens {
        "default"
    } else {
        "client"
    };
    let value = format!(
        "requested={},applied={applied},reason={reason},source={source}",
        plan.requested_max_tokens
    );
    HeaderValue::from_str(&value).ok()
}

/// `X-Acs-Upstream-Model` / `X-Acs-Upstream-Gpu`: which backend served (or failed); the
/// model only once the upstream has said what it serves.
fn upstream_tags(
    upstream: Option<&Node>,
    served: Option<&Served>,
) -> Vec<(HeaderName, HeaderValue)> {
    let mut tags = Vec::with_capacity(2);
    if let Some(value) = served.and_then(|s| HeaderValue::from_str(&s.name).ok()) {
        tags.push((X_ACS_UPSTREAM_MODEL, value));
    }
    if let Some(value) = upstream.and_then(|u| HeaderValue::from_str(&u.gpu).ok()) {
        tags.push((X_ACS_UPSTREAM_GPU, value));
    }
    tags
}
