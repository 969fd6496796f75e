//! `POST /v1/completions` at the front door: the body read and checked, then run by
//! the completion core (`completion::pipeline`) and its outcome rendered (`render`),
//! or stored as a job when the client prefers to collect it later (`submission`).
//!
//! The outcome as HTTP: the node's status, content type and body as they came (a
//! streamed body piece by piece, with no layer of its own per frame), the upstream's
//! model and GPU in `X-Acs-Upstream-Model` / `X-Acs-Upstream-Gpu`, a cut `max_tokens`
//! in `X-Acs-Max-Tokens-Clamped`, and an error as its envelope.
//!
//! An answer committed while its model boots is a 200 at once, kept alive until the
//! answer flows: an SSE comment line (`: booting`) for streams, a space for JSON (JSON
//! allows leading whitespace). An error after that point goes into the body (the
//! contract's "200*" case, without `X-Acs-Upstream-Error-Kind`): the envelope as the
//! whole JSON body, or as one SSE event followed by `data: [DONE]`, the way vLLM
//! reports an error mid-stream.

pub mod chat;
mod submission;

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Frame;
use tracing::Instrument;

use crate::completion::budget_refusal::OnBudgetClamp;
use crate::completion::outcome::{Answer, BootEvent, Booting, Completed, Failed, Outcome, Tags};
use crate::completion::pipeline::{self, Checked, Mode};
use crate::completion::relay::{Metered, Relayed, RelayedBody};
use crate::contract::{
    PREFER, X_ACS_BUDGET_CLAMP, X_ACS_MAX_TOKENS_CLAMPED, X_ACS_UPSTREAM_GPU, X_ACS_UPSTREAM_MODEL,
};
use crate::error::ApiError;
use crate::http::auth::Caller;
use crate::http::body::{Reading, read_limited, require_json};
use crate::http::every_request::{RequestId, workload};
use crate::jobs;
use crate::request_record::RequestRecord;
use crate::state::AppState;

#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "completions",
    request_body(content = crate::http::openapi::CompletionRequestDoc, content_type = "application/json"),
    params(
        ("Prefer" = Option<String>, Header, description = "`respond-async` (RFC 7240) submits the request as a completion job: it is checked and admitted as a synchronous call would be (every 400/401/413/429 below applies, and it counts as one start against the key's rate), then answered 202 with `Location: /v1/harvest/{id}`; collect the result there. `stream: true` is a 400 with it. The job's run takes the key's slots and budget when a worker starts it."),
        ("Idempotency-Key" = Option<String>, Header, description = "With `Prefer: respond-async`: a client-chosen key (1–255 visible ASCII characters, optionally quoted) for safe retries. The same key with the same body answers 200 with the job already submitted; with another body 422 `idempotency_key_reused`. Scoped to the API key; remembered until the job's row is deleted, 7 days after it ends."),
        ("X-Acs-Workload" = Option<String>, Header, description = "`interactive` or `batch`: what the request is for (capacity planning and keep-warm). Jobs run as `batch`."),
        ("X-Acs-Budget-Clamp" = Option<String>, Header, description = "`clamp` (default): where the key's budget cannot cover `max_tokens`, run with fewer (`X-Acs-Max-Tokens-Clamped` says so); `refuse`: answer 429 `budget_exceeded` instead, naming what is left and what the request needs (the Workbench and Loom send this). Another value is 400 `invalid_request`. Not for job submissions (`Prefer: respond-async`), whose runs clamp."),
    ),
    responses(
        (status = 202, description = "With `Prefer: respond-async`: the job was stored (`status: queued`). Harvest it at `Location`.", body = crate::http::openapi::JobDoc,
            headers(
                ("Location" = String, description = "`/v1/harvest/{id}`."),
                ("Preference-Applied" = String, description = "`respond-async`."),
            )),
        (status = 422, description = "`idempotency_key_reused`: the `Idempotency-Key` was used by this key for a job with another body.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 200, description = "A text_completion object (JSON), or an SSE stream of them when `stream` is true; passed through verbatim from vLLM. After a confirmed cold boot of a sleeping model, the 200 is sent at once and the connection kept alive (`: booting` SSE comment lines, or leading spaces before the JSON) until the answer flows; an error after that point arrives in the body as the error envelope (JSON), or as an SSE `data:` event with the envelope followed by `data: [DONE]`, without `X-Acs-Upstream-Error-Kind`.",
            headers(
                ("X-Request-Id" = String, description = "Trace id of this request; also `request_id` in error bodies."),
                ("X-Acs-Upstream-Model" = String, description = "The checkpoint that served the request."),
                ("X-Acs-Upstream-Gpu" = String, description = "The GPU node that served the request."),
                ("X-Acs-Max-Tokens-Clamped" = String, description = "Present when max_tokens was reduced: `requested=N,applied=M,reason=budget|deadline|deadline+budget,source=client|default`. `budget`: to fit the key's budget; `deadline`: you omitted max_tokens on a non-streaming request and the default was cut to what can finish inside the request window (send stream=true to keep the full default); `default`: N is the injected default."),
            ),
            content(
                (crate::http::openapi::CompletionResponseDoc = "application/json"),
                (crate::http::openapi::CompletionStreamEventDoc = "text/event-stream"),
            )),
        (status = 400, description = "Invalid request: `invalid_request`, `model_not_found`, `full_vocab_prompt_too_long`, `deadline_infeasible` (a non-streaming request whose max_tokens cannot finish inside the request window; with `X-Should-Retry: false` — send stream=true), or `upstream_bad_request` (the model server rejected it, e.g. context length; with `X-Acs-Upstream-Error-Kind`).", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("X-Should-Retry" = String, description = "`false` on `deadline_infeasible`."))),
        (status = 401, description = "`invalid_api_key`: missing, malformed, unknown or revoked key.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: body over the limit. Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("X-Should-Retry" = String, description = "`false`: a retry cannot succeed."))),
        (status = 429, description = "`rate_limited` (more starts per minute than the key's rate), `queue_full` (the key's running and waiting requests are at their limits; for a job submission, also: the key has `jobs.max_pending_per_key` jobs queued or running, or their request bodies and this one's would hold more than `jobs.max_pending_bytes_per_key` bytes) or `budget_exceeded` (what is left of the monthly token budget is less than the request needs, or than its full `max_tokens` with `X-Acs-Budget-Clamp: refuse`; also `X-Should-Retry: false`). Always with `Retry-After`.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait; for `budget_exceeded`, until the budget resets."),
                ("X-Should-Retry" = String, description = "`false` on `budget_exceeded`."),
            )),
        (status = 502, description = "`upstream_error`: the model server failed (a 5xx, or it stopped answering mid-request). A request that provably never started on a node (connection refused or reset before any response, or a 503) is retried once on another node before this is returned. Carries `Retry-After` and `X-Acs-Upstream-Error-Kind`.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait before retrying."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "Mirrors `error.code`."),
            )),
        (status = 503, description = "`upstream_unavailable`: no node of the model is up or reachable, a sleeping model could not be woken, or every node is at capacity and the fleet queue is full or timed out (with `X-Acs-Upstream-Error-Kind`); or `admission_unavailable`: the shared limit counters cannot be reached, so nothing may start; or `store_unavailable`: the key is not among the keys this server holds in memory and the store cannot be reached to look it up, or the store has been away so long that the usage waiting to be recorded reached its bound. All carry `Retry-After`.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(
                ("Retry-After" = u32, description = "Seconds to wait before retrying."),
                ("X-Acs-Upstream-Error-Kind" = String, description = "Mirrors `error.code`."),
            )),
        (status = 504, description = "`upstream_deadline`: the model server did not finish a non-streaming request inside the request window; the generation was stopped. `X-Should-Retry: false` and no `Retry-After`: the same request would time out again (send stream=true or lower max_tokens).", body = crate::http::openapi::ErrorEnvelopeDoc,
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
    Extension(reading): Extension<Arc<Reading>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    require_json(&headers)?;
    let config = state.config();
    let body_timeout = Duration::from_millis(config.connections.body_read_timeout_ms);
    let held = reading.hold(caller.0.id, &headers, config.max_body_bytes)?;
    // Reading the body is part of parsing it: a slow upload shows here.
    let parse = tracing::debug_span!("parse");
    let bytes = read_limited(&headers, body, config.max_body_bytes, body_timeout)
        .instrument(parse.clone())
        .await?;
    drop(held);
    let checked = parse.in_scope(|| Checked::parse(&state, &bytes, &record))?;
    drop(parse); // its span ends with the checks
    let key = &caller.0;
    if prefers_async(&headers) {
        let idempotency_key = submission::idempotency_key(&headers)?;
        let submitted =
            jobs::submit::submit(&state, key, &request_id.0, idempotency_key, &bytes, checked)
                .await?;
        return Ok(submission::answer(&state, &submitted));
    }
    let mode = Mode::synchronous(&state, on_budget_clamp(&headers)?, workload(&headers));
    let outcome = pipeline::complete(&state, key, &request_id.0, record, checked, mode).await;
    Ok(render(outcome, &request_id.0))
}

/// Whether any `Prefer` header asks for `respond-async` (RFC 7240: a comma-separated
/// list of preferences, each a token with optional `=value` and `;` parameters).
pub fn prefers_async(headers: &HeaderMap) -> bool {
    headers
        .get_all(PREFER)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|preference| {
            let name = preference.split([';', '=']).next().unwrap_or("").trim();
            name.eq_ignore_ascii_case("respond-async")
        })
}

/// `X-Acs-Budget-Clamp` (`clamp` or `refuse`, case-insensitive; absent: `clamp`). Any
/// other value is a 400: guessing could run a request the client asked to have refused.
fn on_budget_clamp(headers: &HeaderMap) -> Result<OnBudgetClamp, ApiError> {
    let Some(value) = headers.get(X_ACS_BUDGET_CLAMP) else {
        return Ok(OnBudgetClamp::Clamp);
    };
    match value.to_str().map(str::trim) {
        Ok(v) if v.eq_ignore_ascii_case("clamp") => Ok(OnBudgetClamp::Clamp),
        Ok(v) if v.eq_ignore_ascii_case("refuse") => Ok(OnBudgetClamp::Refuse),
        _ => Err(ApiError::invalid(
            "X-Acs-Budget-Clamp must be 'clamp' or 'refuse'.",
        )),
    }
}

/// The response to a completion served as request `request_id`.
fn render(outcome: Outcome, request_id: &str) -> Response {
    let (mut response, tags) = match outcome {
        Ok(Completed { answer, tags }) => {
            let response = match answer {
                Answer::Relayed(relayed) => relayed_response(relayed),
                Answer::Booting(booting) => booting_response(booting, request_id.to_owned()),
            };
            (response, tags)
        }
        Err(Failed { error, tags, .. }) => (error.into_response(), tags),
    };
    tag(&mut response, &tags);
    response
}

fn tag(response: &mut Response, tags: &Tags) {
    let headers = response.headers_mut();
    let clamp = tags.clamp.map(|clamp| clamp.to_string());
    for (name, value) in [
        (
            X_ACS_UPSTREAM_MODEL,
            tags.served.as_ref().map(|s| s.name.as_str()),
        ),
        (
            X_ACS_UPSTREAM_GPU,
            tags.node.as_ref().map(|n| n.gpu.as_str()),
        ),
        (X_ACS_MAX_TOKENS_CLAMPED, clamp.as_deref()),
    ] {
        if let Some(value) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert(name, value);
        }
    }
}

fn relayed_response(relayed: Relayed) -> Response {
    let Relayed {
        status,
        content_type,
        body,
    } = relayed;
    let body = match body {
        RelayedBody::Whole(bytes) => Body::from(bytes),
        // Boxed as axum's own boxed body, which `Body::new` takes as it is: any other
        // body it wraps in a layer that maps its errors, one more for every frame to pass.
        RelayedBody::Streamed(metered) => Body::new(UnsyncBoxBody::new(Streamed(metered))),
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    if let Some(value) = content_type {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

/// A streamed answer as a body of its own rather than a stream made into one, with
/// axum's error type: one layer less for each of hyper's polls, twice a frame.
struct Streamed(Metered);

impl hyper::body::Body for Streamed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.get_mut()
            .0
            .poll_piece(cx)
            .map(|piece| piece.map(|piece| piece.map(Frame::data).map_err(axum::Error::new)))
    }
}

fn booting_response(booting: Booting, request_id: String) -> Response {
    let Booting { stream, mut events } = booting;
    let content_type = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    let body = futures_util::stream::poll_fn(move |cx| {
        events
            .poll_recv(cx)
            .map(|event| event.map(|event| boot_piece(event, stream, &request_id)))
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, content_type),
            // A compressor would hold the keep-alive bytes back.
            (header::CONTENT_ENCODING, "identity"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

fn boot_piece(event: BootEvent, stream: bool, request_id: &str) -> io::Result<Bytes> {
    match event {
        BootEvent::KeepAlive if stream => Ok(Bytes::from_static(b": booting\n\n")),
        BootEvent::KeepAlive => Ok(Bytes::from_static(b" ")),
        BootEvent::Piece(bytes) => Ok(bytes),
        BootEvent::Failed(err) => Ok(in_body_error(&err, request_id, stream)),
        BootEvent::Cut(err) => Err(err),
    }
}

/// The error envelope as the whole JSON body, or as an SSE event and `[DONE]`.
fn in_body_error(err: &ApiError, request_id: &str, stream: bool) -> Bytes {
    let json = err.body().envelope_json(request_id);
    if !stream {
        return Bytes::from(json);
    }
    let mut event = Vec::with_capacity(json.len() + 32);
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(&json);
    event.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    Bytes::from(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The headers `pairs` (a name may come more than once).
    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    fn with(value: &str) -> HeaderMap {
        headers(&[("x-acs-budget-clamp", value)])
    }

    #[test]
    fn respond_async_is_found_among_other_preferences() {
        assert!(prefers_async(&headers(&[("prefer", "respond-async")])));
        assert!(prefers_async(&headers(&[(
            "prefer",
            "return=minimal, Respond-Async; wait=10"
        )])));
        assert!(prefers_async(&headers(&[
            ("prefer", "wait=5"),
            ("prefer", "respond-async")
        ])));
        assert!(!prefers_async(&headers(&[(
            "prefer",
            "respond-asynchronously"
        )])));
        assert!(!prefers_async(&headers(&[])));
    }

    #[test]
    fn the_budget_clamp_header_decides() {
        assert_eq!(
            on_budget_clamp(&HeaderMap::new()).ok(),
            Some(OnBudgetClamp::Clamp)
        );
        assert_eq!(
            on_budget_clamp(&with("refuse")).ok(),
            Some(OnBudgetClamp::Refuse)
        );
        assert_eq!(
            on_budget_clamp(&with(" Refuse ")).ok(),
            Some(OnBudgetClamp::Refuse)
        );
        assert_eq!(
            on_budget_clamp(&with("clamp")).ok(),
            Some(OnBudgetClamp::Clamp)
        );
        let err = on_budget_clamp(&with("never")).unwrap_err();
        assert_eq!(err.code(), "invalid_request");
    }
}
