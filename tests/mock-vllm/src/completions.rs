//! `POST /v1/completions`: failure modes, the gate, validation, a place in the batch,
//! generation, and the paced response body (stream or not).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::body::{ChoiceBody, Meta, NonStreamBody, reported_completion_tokens};
use super::config::FailureMode;
use super::endpoints::{now_secs, receive};
use super::error::VllmError;
use super::generate::{Generated, generate};
use super::logprobs::{LogprobsJson, PromptLogprobsWriter, StepLogprobs, prompt_rows};
use super::request::{self, Plan};
use super::sse::{Frame, Pace, StreamBuilder, StreamChoice};
use super::state::{InFlight, Shared};

pub(crate) async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let created = now_secs();
    let received = match receive(&shared, request).await {
        Ok(r) => r,
        Err(response) => return response,
    };
    let mut guard = InFlight::enter(&shared);
    shared.gate_passed().await;
    let cut = match shared.failure() {
        FailureMode::Hang => return std::future::pending().await,
        FailureMode::Status500 => {
            guard.finish();
            return VllmError::internal().into_response();
        }
        FailureMode::CutStream { after_chunks } => Some(after_chunks),
        FailureMode::None
        | FailureMode::Refuse
        | FailureMode::StreamError { .. }
        | FailureMode::Endless
        | FailureMode::Overgenerate
        | FailureMode::AbsurdUsage => None,
    };
    let mut plan = match request::parse(
        &shared.config,
        &shared.tokenizer,
        &received.headers,
        &received.body,
    ) {
        Ok(plan) => plan,
        Err(e) => {
            guard.finish();
            return e.into_response();
        }
    };
    // Valid: into the engine, where it waits for a place in the batch.
    guard.schedule().await;
    let prompts: Vec<&[u32]> = plan.prompts.iter().map(|p| p.ids.as_slice()).collect();
    shared.prefill(&prompts).await;
    match shared.failure() {
        FailureMode::StreamError { after_chunks } => plan.error_after = Some(after_chunks),
        FailureMode::AbsurdUsage => plan.absurd_usage = true,
        _ => {}
    }
    let meta = Meta {
        id: format!(
            "cmpl-{}",
            request_id(&received.headers, plan.request_id.as_deref())
        ),
        created,
        model: shared.config.served_model_name.clone(),
    };
    if plan.stream && shared.failure() == FailureMode::Overgenerate {
        return overgenerated(&shared, &meta, guard);
    }
    respond(&shared, &plan, &meta, guard, cut).await
}

/// The `Overgenerate` mode's stream: one-token frames, paced by `token_delay`, until
/// the client goes away.
fn overgenerated(shared: &Shared, meta: &Meta, guard: InFlight) -> Response {
    let chunk = json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "text": " the", "logprobs": null, "finish_reason": null, "stop_reason": null}],
        "usage": null,
    });
    let frame = Frame {
        delay: shared.config.token_delay,
        data: bytes::Bytes::from(format!("data: {chunk}\n\n")),
    };
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
        paced_body(std::iter::repeat(frame), guard, None),
    )
        .into_response()
}

/// The `X-Request-Id` header wins over the body's `request_id`; else a fresh uuid4 hex.
fn request_id(headers: &HeaderMap, body_id: Option<&str>) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .or(body_id)
        .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned)
}

async fn respond(
    shared: &Shared,
    plan: &Plan,
    meta: &Meta,
    mut guard: InFlight,
    cut: Option<usize>,
) -> Response {
    let config = &shared.config;
    let pace = Pace {
        first: config.time_to_first_token,
        between: config.token_delay,
    };
    let builder = StreamBuilder {
        meta,
        plan,
        tokenizer: &shared.tokenizer,
        model: &shared.model,
        pace,
    };
    if plan.max_tokens.is_none() {
        // vLLM asserts `max_tokens is not None` while building the response.
        if plan.stream {
            return event_stream(builder.failing(""), guard, cut);
        }
        tokio::time::sleep(pace.first).await;
        guard.finish();
        return VllmError::internal().into_response();
    }

    // Choices in index order: prompt-major, then n.
    let mut choices: Vec<(usize, Generated)> =
        Vec::with_capacity(plan.prompts.len() * plan.n as usize);
    for (p, prompt) in plan.prompts.iter().enumerate() {
        let room = config.max_model_len.saturating_sub(prompt.ids.len() as u32);
        for j in 0..plan.n {
            let max_tokens = plan.params.max_tokens.min(room);
            choices.push((
                p,
                generate(
                    &shared.model,
                    &shared.tokenizer,
                    &prompt.ids,
                    j,
                    max_tokens,
                    &plan.params,
                ),
            ));
        }
    }

    if plan.stream {
        let stream_choices: Vec<StreamChoice> = choices
            .iter()
            .enumerate()
            .map(|(index, (p, generated))| StreamChoice {
                index,
                prompt: &plan.prompts[*p],
                generated,
            })
            .collect();
        return event_stream(builder.frames(&stream_choices), guard, cut);
    }

    let longest = choices.iter().map(|(_, g)| g.ids.len()).max().unwrap_or(0) as u32;
    let generation = pace.first + pace.between * longest.saturating_sub(1);
    // A zero sleep still waits for the timer's next 1 ms tick: skip it, as the stream does.
    if !generation.is_zero() {
        tokio::time::sleep(generation).await;
    }
    let prompt_tokens: usize = plan.prompts.iter().map(|p| p.ids.len()).sum();
    let completion_tokens =
        reported_completion_tokens(plan, choices.iter().map(|(_, g)| g.ids.len()).sum());
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens.saturating_add(completion_tokens),
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": null,
    });
    let prompt_ids: Vec<Arc<Vec<u32>>> = plan
        .prompts
        .iter()
        .map(|p| Arc::new(p.ids.clone()))
        .collect();
    let bodies = choices
        .iter()
        .enumerate()
        .map(|(index, (p, generated))| {
            choice_body(
                shared,
                plan,
                index,
                &prompt_ids[*p],
                &plan.prompts[*p].echo_text,
                generated,
            )
        })
        .collect();
    let body = NonStreamBody::new(meta, bodies, usage);
    let content_type = [(header::CONTENT_TYPE, "application/json")];
    if plan.prompt_logprobs == Some(-1) {
        // Tens of MB or more: generated while it is sent.
        return (
            StatusCode::OK,
            content_type,
            paced_body(body.map(immediate), guard, cut.map(|_| 1)),
        )
            .into_response();
    }
    let bytes = body.collect_all();
    if cut.is_some() {
        let half = [
            bytes.slice(..bytes.len() / 2),
            bytes.slice(bytes.len() / 2..),
        ];
        return (
            StatusCode::OK,
            content_type,
            paced_body(half.into_iter().map(immediate), guard, Some(1)),
        )
            .into_response();
    }
    guard.finish();
    (StatusCode::OK, content_type, bytes).into_response()
}

fn choice_body(
    shared: &Shared,
    plan: &Plan,
    index: usize,
    prompt_ids: &Arc<Vec<u32>>,
    echo_text: &str,
    generated: &Generated,
) -> ChoiceBody {
    let mut text = String::new();
    if plan.echo && !plan.return_token_ids {
        text.push_str(echo_text);
    }
    if !plan.discard_output {
        text.push_str(&generated.text);
    }
    let logprobs = plan.params.logprobs.map_or(Value::Null, |k| {
        let prompt_part = if plan.echo {
            prompt_rows(&shared.model, prompt_ids, plan.echo_prompt_top(k as usize))
        } else {
            Vec::new()
        };
        let own: &[StepLogprobs] = if plan.discard_output {
            &[]
        } else {
            &generated.logprobs
        };
        let rows = prompt_ids
            .iter()
            .zip(&prompt_part)
            .map(|(&id, step)| (id, step.as_ref()))
            .chain(
                generated
                    .ids
                    .iter()
                    .zip(own)
                    .map(|(&id, step)| (id, Some(step))),
            );
        let json = LogprobsJson {
            tokenizer: &shared.tokenizer,
            as_ids: plan.tokens_as_ids,
        };
        json.build(rows, 0).0
    });
    let ids_or_null = |ids: &[u32]| {
        if plan.return_token_ids {
            json!(ids)
        } else {
            Value::Null
        }
    };
    let mut head = Map::new();
    head.insert("index".into(), json!(index));
    head.insert("text".into(), json!(text));
    head.insert("logprobs".into(), logprobs);
    head.insert("finish_reason".into(), json!(generated.finish_reason));
    head.insert("stop_reason".into(), generated.stop_reason.to_json());
    head.insert("token_ids".into(), ids_or_null(&generated.ids));
    ChoiceBody {
        head,
        prompt_logprobs: plan.prompt_logprobs.map(|k| {
            PromptLogprobsWriter::new(
                shared.model.clone(),
                shared.tokenizer.clone(),
                Arc::clone(prompt_ids),
                k,
            )
        }),
        prompt_token_ids: ids_or_null(prompt_ids),
    }
}

fn immediate(data: bytes::Bytes) -> Frame {
    Frame {
        delay: Duration::ZERO,
        data,
    }
}

/// An SSE response; `CutStream` drops it before `[DONE]` at the latest.
fn event_stream(frames: Vec<Frame>, guard: InFlight, cut: Option<usize>) -> Response {
    let cut = cut.map(|k| k.min(frames.len().saturating_sub(1)));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
        paced_body(frames.into_iter(), guard, cut),
    )
        .into_response()
}

/// A body that sends `frames` with their delays, and, when `cut_after` is set, fails
/// after that many frames so hyper drops the connection mid-body. The in-flight guard
/// lives in the stream: dropping the body early (client gone) counts a cancellation.
fn paced_body(
    frames: impl Iterator<Item = Frame> + Send + 'static,
    guard: InFlight,
    cut_after: Option<usize>,
) -> Body {
    struct Paced<I> {
        frames: I,
        guard: InFlight,
        left: Option<usize>,
        done: bool,
    }
    let state = Paced {
        frames,
        guard,
        left: cut_after,
        done: false,
    };
    Body::from_stream(futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        if st.left == Some(0) {
            // Let hyper flush what was sent before failing the body, which aborts the
            // connection without the chunked terminator.
            tokio::task::yield_now().await;
            st.guard.finish();
            st.done = true;
            return Some((Err(io::Error::other("mock-vllm: CutStream")), st));
        }
        let Some(frame) = st.frames.next() else {
            st.guard.finish();
            return None;
        };
        if !frame.delay.is_zero() {
            tokio::time::sleep(frame.delay).await;
        }
        if let Some(left) = &mut st.left {
            *left -= 1;
        }
        Some((Ok(frame.data), st))
    }))
}
