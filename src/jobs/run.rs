//! One run of a job: the stored request through the same pipeline as a synchronous call
//! (admission with the key's slots and budget, dispatch, relay, metering), its lease
//! renewed while it runs, and its end written fenced by the attempt.
//!
//! How a run ends:
//! - an answer from the node (a success, or an error a synchronous call would have got
//!   once a node had the request) ends the job: `succeeded` with the body, or `failed`
//!   with the envelope. A run that may have started on a node is never re-run;
//! - a refusal before any node had it (no node up, admission or store unavailable) is
//!   retried with back-off, up to `jobs.max_attempts` runs; a key at its slots or rate
//!   waits its turn within the same run;
//! - a cancel stops it upstream at once; the job ends `cancelled`;
//! - shutdown past its grace cuts it: the job is queued again for the next worker;
//! - a lost lease (this worker was too slow to renew it, and another took the job over)
//!   stops it; the other worker's run is the job's.
//!
//! Every run settles its usage under the job's id, so the ledger charges a job once.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

use crate::admission::Month;
use crate::backoff::Backoff;
use crate::completion::budget_refusal::OnBudgetClamp;
use crate::completion::dispatch::{NotSent, stopped_answering};
use crate::completion::pipeline::{self, Checked, Mode};
use crate::contract::X_ACS_WORKLOAD;
use crate::error::{ApiError, ErrorBody};
use crate::http::auth::Caller;
use crate::http::envelope::envelope_json;
use crate::http::request_record::RequestRecord;
use crate::state::AppState;
use crate::store::{JobRow, JobStatus, Outcome, UsageRow, now_unix, now_unix_ms};

/// The largest result body kept (a completion with many logprobs is large, but not
/// this large).
const MAX_RESULT_BYTES: usize = 64 << 20;
/// Lease renewals come at least this often, so a cancel made on another replica
/// reaches the run within about this long.
const MAX_RENEW_EVERY: Duration = Duration::from_secs(1);
/// Between runs of a job that never reached a node.
const RETRY: Backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
/// Between tries to write a run's end while the store fails.
const FINISH_RETRY: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));

/// How the pipeline answered a run.
enum Answer {
    /// The body, and the prompt and completion tokens of its `usage`.
    Succeeded(Bytes, Option<u64>, Option<u64>),
    Failed {
        status: StatusCode,
        error: ErrorBody,
        retry_after: Option<Duration>,
        /// Whether no node can have received the request (see
        /// [`crate::completion::dispatch::NotSent`]): only then may it run again.
        not_sent: bool,
    },
}

/// Why a run stopped.
enum Stop {
    Answered(Answer),
    Cancelled,
    Cut,
    Lost,
}

/// Runs `job` (claimed as attempt `job.attempts`), holding `_slot` of this replica's
/// workers until it is done.
pub async fn run(
    state: AppState,
    job: JobRow,
    cut: CancellationToken,
    _slot: OwnedSemaphorePermit,
) {
    let _running = state.metrics().job_running();
    let hub = state.jobs().clone();
    let cancel = CancellationToken::new();
    hub.running_here(&job.id, job.attempts, cancel.clone());
    let stop = if job.cancel_requested != 0 {
        Stop::Cancelled
    } else if job.attempts > i64::from(state.config().jobs.max_attempts) {
        Stop::Answered(abandoned(job.attempts - 1))
    } else {
        supervise(&state, &job, &cancel, &cut).await
    };
    hub.not_running_here(&job.id, job.attempts);
    conclude(&state, &job, stop, &cut).await;
}

/// The run, its lease renewed, until it answers or is stopped.
async fn supervise(
    state: &AppState,
    job: &JobRow,
    cancel: &CancellationToken,
    cut: &CancellationToken,
) -> Stop {
    let settings = &state.config().jobs;
    let lease_ms = i64::try_from(settings.lease_ms).unwrap_or(i64::MAX);
    let renew_every = (Duration::from_millis(settings.lease_ms) / 3).min(MAX_RENEW_EVERY);
    let answer = attempt(state, job);
    tokio::pin!(answer);
    let mut renewals = tokio::time::interval(renew_every);
    renewals.tick().await;
    // The lease as last confirmed by the store. Once it is about to lapse unrenewed (a
    // store this replica cannot reach), the run stops: another replica may take the job
    // over, and two runs must not overlap.
    let mut held_until = job.lease_until_ms.unwrap_or(0);
    let margin = lease_ms / 3;
    loop {
        tokio::select! {
            answer = &mut answer => return Stop::Answered(answer),
            () = cancel.cancelled() => return Stop::Cancelled,
            () = cut.cancelled() => return Stop::Cut,
            _ = renewals.tick() => {
                let until = now_unix_ms().saturating_add(lease_ms);
                match state.store().jobs().renew(&job.id, job.attempts, until).await {
                    Ok(Some(false)) => held_until = until,
                    Ok(Some(true)) => return Stop::Cancelled,
                    Ok(None) => return Stop::Lost,
                    Err(err) if now_unix_ms() >= held_until.saturating_sub(margin) => {
                        tracing::warn!(job_id = %job.id, error = %err, "could not renew a job's lease before it lapses; stopping its run");
                        return Stop::Lost;
                    }
                    // The lease still runs; the next renewal tries again.
                    Err(err) => tracing::warn!(job_id = %job.id, error = %err, "could not renew a job's lease"),
                }
            }
        }
    }
}

/// The run proper: a key at its slots or rate waits here (the same attempt) and tries
/// again, each try a request of its own (`{job id}.{attempt}.{try}`).
async fn attempt(state: &AppState, job: &JobRow) -> Answer {
    let mut tries = 0_u32;
    loop {
        tries += 1;
        let request_id = format!("{}.{}.{tries}", job.id, job.attempts);
        let answer = answer(state, job, &request_id).await;
        match &answer {
            Answer::Failed {
                error,
                retry_after: Some(wait),
                not_sent: true,
                ..
            } if matches!(error.code, "queue_full" | "rate_limited") => {
                tokio::time::sleep(*wait).await;
            }
            _ => return answer,
        }
    }
}

/// Runs the stored request once as `request_id`.
async fn answer(state: &AppState, job: &JobRow, request_id: &str) -> Answer {
    let Some(body) = job.request.as_deref() else {
        // Content goes only after a job ends; a running job always has its request.
        return failed(ApiError::internal(anyhow::anyhow!(
            "job {} has no request",
            job.id
        )));
    };
    let Some(caller) = caller(state, job.key_id).await else {
        return failed(ApiError::Unauthorized("This API key has been revoked."));
    };
    let key = &caller.0;
    let record = RequestRecord::open(
        state,
        request_id.to_owned(),
        "/v1/completions".to_owned(),
        Some("batch".to_owned()),
        None,
    );
    record.set_caller(key.id, &key.prefix, key.email.as_deref());
    let mut headers = HeaderMap::new();
    headers.insert(X_ACS_WORKLOAD, HeaderValue::from_static("batch"));
    let mode = Mode {
        window: Some(Duration::from_millis(state.config().jobs.run_timeout_ms)),
        job: Some(&job.id),
        // A job has no one to ask: it runs with what the budget allows, as the API clamps.
        on_budget_clamp: OnBudgetClamp::Clamp,
    };
    let response = match Checked::parse(state, body, &record) {
        Ok(checked) => {
            pipeline::complete(
                state,
                &caller,
                request_id,
                record.clone(),
                &headers,
                checked,
                mode,
            )
            .await
        }
        // The stored request no longer fits the config (its model was removed by a
        // reload, say): running it again cannot help.
        Err(err) => err.into_response(),
    };
    let answer = read(response).await;
    match &answer {
        Answer::Succeeded(..) => record.set_outcome(200, None),
        Answer::Failed { status, error, .. } => {
            record.set_outcome(status.as_u16(), Some(error.code));
        }
    }
    record.release();
    answer
}

/// The pipeline's response as an answer: its error, or its whole body.
async fn read(response: Response) -> Answer {
    let status = response.status();
    if let Some(error) = response.extensions().get::<ErrorBody>().cloned() {
        let retry_after = response
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .map(Duration::from_secs);
        let not_sent = response.extensions().get::<NotSent>().is_some();
        return Answer::Failed {
            status,
            error,
            retry_after,
            not_sent,
        };
    }
    match axum::body::to_bytes(response.into_body(), MAX_RESULT_BYTES).await {
        Ok(body) => match Summary::of(&body) {
            // After a cold boot the 200 was committed and the error came in the body.
            // The node may have had the request by then.
            Summary {
                error: Some(error), ..
            } => Answer::Failed {
                status: StatusCode::BAD_GATEWAY,
                error: error.body(),
                retry_after: None,
                not_sent: false,
            },
            Summary { usage, .. } => {
                let usage = usage.unwrap_or_default();
                Answer::Succeeded(body, usage.prompt_tokens, usage.completion_tokens)
            }
        },
        // The node stopped answering mid-body (or the body was over the limit).
        Err(_) => failed(stopped_answering()),
    }
}

/// What a whole 200 body says, read in one pass: the envelope's `error` of a body that
/// is one (`{"error": {…}, …}`), else the `usage` of a completion.
#[derive(Default, serde::Deserialize)]
struct Summary {
    error: Option<InBodyError>,
    usage: Option<BodyUsage>,
}

#[derive(serde::Deserialize)]
struct InBodyError {
    code: String,
    message: String,
}

#[derive(Default, serde::Deserialize)]
struct BodyUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

impl Summary {
    fn of(body: &[u8]) -> Self {
        serde_json::from_slice(body).unwrap_or_default()
    }
}

impl InBodyError {
    fn body(self) -> ErrorBody {
        ErrorBody {
            // The codes are the gateway's own (`&'static`): find ours by name.
            code: known_code(&self.code),
            message: self.message,
            kind: "server_error",
            param: None,
        }
    }
}

/// The gateway's error code of this name, or `upstream_error`.
fn known_code(code: &str) -> &'static str {
    const CODES: [&str; 4] = [
        "upstream_unavailable",
        "upstream_deadline",
        "admission_unavailable",
        "store_unavailable",
    ];
    CODES
        .into_iter()
        .find(|c| *c == code)
        .unwrap_or("upstream_error")
}

fn failed(error: ApiError) -> Answer {
    let response = error.into_response();
    let status = response.status();
    let error = response
        .extensions()
        .get::<ErrorBody>()
        .cloned()
        .unwrap_or(ErrorBody {
            code: "internal_error",
            message: "internal error".to_owned(),
            kind: "server_error",
            param: None,
        });
    Answer::Failed {
        status,
        error,
        retry_after: None,
        not_sent: false,
    }
}

/// A job started `runs` times without an end: each run was cut short (its server
/// stopped or died) or refused before it had a node.
fn abandoned(runs: i64) -> Answer {
    failed(ApiError::UpstreamRejected {
        status: StatusCode::BAD_GATEWAY,
        kind: "upstream_error",
        message: format!(
            "This job was started {runs} times without finishing (each run was cut short, or no node could take it); it is not started again."
        ),
    })
}

/// The key that submitted the job, if it is still active.
async fn caller(state: &AppState, key_id: i64) -> Option<Caller> {
    let mut key = state.keys().by_id(key_id);
    if key.is_none() {
        // Created on another replica a moment ago: the change feed has it.
        let _ = state.keys().pull().await;
        key = state.keys().by_id(key_id);
    }
    key.filter(|key| key.is_active()).map(Caller)
}

/// Writes how the run ended (fenced by its attempt) and wakes the long-polls. The end
/// is written however long the store takes to come back (until shutdown cuts it):
/// giving up would throw a finished result away and run the job again.
async fn conclude(state: &AppState, job: &JobRow, stop: Stop, cut: &CancellationToken) {
    let metrics = state.metrics();
    let jobs = state.store().jobs();
    let now = now_unix_ms();
    let outcome = match stop {
        Stop::Lost => {
            metrics.job_run("lost");
            tracing::warn!(job_id = %job.id, attempt = job.attempts, "lost a job's lease; another worker has it");
            return;
        }
        Stop::Cut => {
            metrics.job_run("requeued");
            if let Err(err) = jobs.requeue(&job.id, job.attempts, now, now).await {
                // Its lease lapses and another worker takes it over.
                tracing::warn!(job_id = %job.id, error = %err, "could not queue a cut job again");
            }
            return;
        }
        Stop::Answered(Answer::Failed {
            error,
            not_sent: true,
            ..
        }) if job.attempts < i64::from(state.config().jobs.max_attempts) => {
            metrics.job_run("retried");
            let attempt = u32::try_from(job.attempts).unwrap_or(u32::MAX);
            let pause = RETRY.after(attempt);
            let due = now.saturating_add(i64::try_from(pause.as_millis()).unwrap_or(i64::MAX));
            tracing::info!(job_id = %job.id, attempt, code = error.code, "job never reached a node; retrying later");
            if let Err(err) = jobs.requeue(&job.id, job.attempts, due, now).await {
                tracing::warn!(job_id = %job.id, error = %err, "could not queue a job again");
            }
            return;
        }
        Stop::Cancelled => Outcome {
            status: JobStatus::Cancelled,
            result: None,
            result_status: None,
            error_code: None,
            prompt_tokens: None,
            completion_tokens: None,
            charge: None,
        },
        Stop::Answered(Answer::Succeeded(body, prompt_tokens, completion_tokens)) => {
            let charge = prompt_tokens
                .zip(completion_tokens)
                .map(|(prompt, completion)| UsageRow {
                    key_id: job.key_id,
                    request_id: job.id.clone(),
                    month: Month::now().to_string(),
                    prompt_tokens: prompt,
                    completion_tokens: completion,
                    created_at: now_unix(),
                });
            Outcome {
                status: JobStatus::Succeeded,
                result: Some(body.to_vec()),
                result_status: Some(200),
                error_code: None,
                prompt_tokens,
                completion_tokens,
                charge,
            }
        }
        Stop::Answered(Answer::Failed { status, error, .. }) => {
            let request_id = format!("{}.{}", job.id, job.attempts);
            Outcome {
                status: JobStatus::Failed,
                result: Some(envelope_json(&error, &request_id)),
                result_status: Some(status.as_u16()),
                error_code: Some(error.code.to_owned()),
                prompt_tokens: None,
                completion_tokens: None,
                charge: None,
            }
        }
    };
    let mut pauses = FINISH_RETRY.pauses();
    loop {
        match jobs.finish(&job.id, job.attempts, &outcome, now).await {
            Ok(true) => {
                metrics.job_run(outcome.status.as_str());
                tracing::info!(job_id = %job.id, attempt = job.attempts, status = outcome.status.as_str(), "job ended");
                state.jobs().ended(&job.id);
                return;
            }
            Ok(false) => {
                metrics.job_run("lost");
                tracing::warn!(job_id = %job.id, attempt = job.attempts, "a job's run ended after another worker took it over; its end is not kept");
                return;
            }
            Err(err) => {
                tracing::warn!(job_id = %job.id, error = %err, "could not write a job's end; retrying");
                tokio::select! {
                    () = tokio::time::sleep(pauses.next_pause()) => {}
                    () = cut.cancelled() => {
                        tracing::error!(job_id = %job.id, "shutting down before a job's end could be written; it runs again when its lease lapses");
                        return;
                    }
                }
            }
        }
    }
}
