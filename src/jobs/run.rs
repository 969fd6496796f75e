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
//! Every run settles its usage under the job's id, so the ledger charges a job once; a
//! run cut or stopped by a lost lease is charged nothing (see [`JobRun`]).

use std::time::Duration;

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

use crate::admission::Month;
use crate::backoff::Backoff;
use crate::completion::budget_refusal::OnBudgetClamp;
use crate::completion::dispatch::stopped_answering;
use crate::completion::outcome::{Answer, BootEvent, Booting, Completed, Failed, Outcome};
use crate::completion::pipeline::{self, Checked, Mode};
use crate::completion::relay::RelayedBody;
use crate::completion::settle::JobRun;
use crate::contract::Workload;
use crate::error::ApiError;
use crate::keys::Refusal;
use crate::request_record::RequestRecord;
use crate::state::AppState;
use crate::store::{self, JobRow, JobStatus, KeyRecord, UsageRow, now_unix, now_unix_ms};

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
enum Answered {
    /// The body, and the prompt and completion tokens of its `usage`.
    Succeeded(Bytes, Option<u64>, Option<u64>),
    Failed {
        error: ApiError,
        /// Whether no node can have received the request (see
        /// [`crate::completion::outcome::Failed::sent`]): only then may it run again.
        not_sent: bool,
    },
}

/// Why a run stopped.
enum Stop {
    Answered(Answered),
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
    let job_run = JobRun {
        id: job.id.clone(),
        superseded: CancellationToken::new(),
    };
    let settings = &state.config().jobs;
    let lease_ms = i64::try_from(settings.lease_ms).unwrap_or(i64::MAX);
    let renew_every = (Duration::from_millis(settings.lease_ms) / 3).min(MAX_RENEW_EVERY);
    let answer = attempt(state, job, &job_run);
    tokio::pin!(answer);
    let mut renewals = tokio::time::interval(renew_every);
    renewals.tick().await;
    // The lease as last confirmed by the store. Once it is about to lapse unrenewed (a
    // store this replica cannot reach), the run stops: another replica may take the job
    // over, and two runs must not overlap.
    let mut held_until = job.lease_until_ms.unwrap_or(0);
    let margin = lease_ms / 3;
    let stop = loop {
        tokio::select! {
            // An answer that is there ends the job, whatever came meanwhile: its run has
            // been settled as the job's.
            biased;
            answer = &mut answer => break Stop::Answered(answer),
            () = cancel.cancelled() => break Stop::Cancelled,
            () = cut.cancelled() => break Stop::Cut,
            _ = renewals.tick() => {
                let until = now_unix_ms().saturating_add(lease_ms);
                match state.store().jobs().renew(&job.id, job.attempts, until).await {
                    Ok(Some(false)) => held_until = until,
                    Ok(Some(true)) => break Stop::Cancelled,
                    Ok(None) => break Stop::Lost,
                    Err(err) if now_unix_ms() >= held_until.saturating_sub(margin) => {
                        tracing::warn!(job_id = %job.id, error = %err, "could not renew a job's lease before it lapses; stopping its run");
                        break Stop::Lost;
                    }
                    // The lease still runs; the next renewal tries again.
                    Err(err) => tracing::warn!(job_id = %job.id, error = %err, "could not renew a job's lease"),
                }
            }
        }
    };
    // Before the run is dropped, and so settled: one that does not end its job is
    // charged nothing.
    if matches!(stop, Stop::Cut | Stop::Lost) {
        job_run.superseded.cancel();
    }
    stop
}

/// The run proper: a key at its slots or rate waits here (the same attempt) and tries
/// again, each try a request of its own (`{job id}.{attempt}.{try}`).
async fn attempt(state: &AppState, job: &JobRow, job_run: &JobRun) -> Answered {
    let mut tries = 0_u32;
    loop {
        tries += 1;
        let request_id = format!("{}.{}.{tries}", job.id, job.attempts);
        let answered = answer(state, job, job_run, &request_id).await;
        match &answered {
            Answered::Failed {
                error: error @ (ApiError::QueueFull { .. } | ApiError::RateLimited { .. }),
                not_sent: true,
            } => tokio::time::sleep(error.retry_after().unwrap_or_default()).await,
            _ => return answered,
        }
    }
}

/// Runs the stored request once as `request_id`.
async fn answer(state: &AppState, job: &JobRow, job_run: &JobRun, request_id: &str) -> Answered {
    let Some(body) = job.request.as_deref() else {
        // Content goes only after a job ends; a running job always has its request.
        tracing::error!(job_id = %job.id, "a running job has no request");
        return failed(ApiError::internal(anyhow::anyhow!(
            "job {} has no request",
            job.id
        )));
    };
    let key = match owner(state, job.key_id).await {
        Ok(key) => key,
        Err(refusal) => return failed(refusal.into()),
    };
    let record = RequestRecord::open(
        state,
        request_id.to_owned(),
        "/v1/completions".to_owned(),
        Some(Workload::Batch),
        None,
    );
    record.set_caller(key.id, &key.prefix, key.email.as_deref());
    let mode = Mode {
        window: Some(Duration::from_millis(state.config().jobs.run_timeout_ms)),
        job: Some(job_run),
        // A job has no one to ask: it runs with what the budget allows, as the API clamps.
        on_budget_clamp: OnBudgetClamp::Clamp,
        workload: Some(Workload::Batch),
    };
    let answered = match Checked::parse(state, body, &record) {
        Ok(checked) => {
            let outcome =
                pipeline::complete(state, &key, request_id, record.clone(), checked, mode).await;
            read(outcome).await
        }
        // The stored request no longer fits the config (its model was removed by a
        // reload, say): running it again cannot help.
        Err(err) => failed(err),
    };
    match &answered {
        Answered::Succeeded(..) => record.set_outcome(200, None),
        Answered::Failed { error, .. } => {
            record.set_outcome(error.status().as_u16(), Some(error.code()));
        }
    }
    record.release();
    answered
}

/// The pipeline's outcome as an answer: its error, or its whole body.
async fn read(outcome: Outcome) -> Answered {
    let answer = match outcome {
        Ok(Completed { answer, .. }) => answer,
        Err(Failed { error, sent, .. }) => {
            return Answered::Failed {
                error,
                not_sent: !sent,
            };
        }
    };
    let body = match answer {
        Answer::Relayed(relayed) => read_relayed(relayed.body).await,
        // After a cold boot the answer was committed and an error comes in its place.
        // The node may have had the request by then.
        Answer::Booting(booting) => read_booting(booting).await,
    };
    match body {
        Ok(body) => {
            let usage = BodyUsage::of(&body);
            Answered::Succeeded(body, usage.prompt_tokens, usage.completion_tokens)
        }
        Err(error) => failed(error),
    }
}

/// A relayed body, whole: an error when the node stopped answering mid-body (or the
/// body is over the limit).
async fn read_relayed(body: RelayedBody) -> Result<Bytes, ApiError> {
    let mut body = match body {
        RelayedBody::Whole(bytes) => return Ok(bytes),
        streamed @ RelayedBody::Streamed(_) => streamed,
    };
    let mut whole = Vec::new();
    while let Some(piece) = body.next_piece().await {
        append(&mut whole, &piece.map_err(|_| stopped_answering())?)?;
    }
    Ok(whole.into())
}

/// A booting answer's pieces, whole (its keep-alives left out), or the error that came
/// in their place.
async fn read_booting(mut booting: Booting) -> Result<Bytes, ApiError> {
    let mut whole = Vec::new();
    while let Some(event) = booting.events.recv().await {
        match event {
            BootEvent::KeepAlive => {}
            BootEvent::Piece(piece) => append(&mut whole, &piece)?,
            BootEvent::Failed(error) => return Err(error),
            BootEvent::Cut(_) => return Err(stopped_answering()),
        }
    }
    Ok(whole.into())
}

/// Adds `piece` to a result body, up to [`MAX_RESULT_BYTES`].
fn append(whole: &mut Vec<u8>, piece: &[u8]) -> Result<(), ApiError> {
    if whole.len() + piece.len() > MAX_RESULT_BYTES {
        return Err(stopped_answering());
    }
    whole.extend_from_slice(piece);
    Ok(())
}

/// The prompt and completion tokens of a completion's `usage`.
#[derive(Default, serde::Deserialize)]
struct BodyUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

impl BodyUsage {
    fn of(body: &[u8]) -> Self {
        #[derive(serde::Deserialize)]
        struct Completion {
            usage: Option<BodyUsage>,
        }
        serde_json::from_slice::<Completion>(body)
            .ok()
            .and_then(|completion| completion.usage)
            .unwrap_or_default()
    }
}

/// A failure that ends the job: a node may have had the request, or running it again
/// cannot help.
fn failed(error: ApiError) -> Answered {
    Answered::Failed {
        error,
        not_sent: false,
    }
}

/// A job started `runs` times without an end: each run was cut short (its server
/// stopped or died) or refused before it had a node.
fn abandoned(runs: i64) -> Answered {
    failed(ApiError::UpstreamRejected {
        status: StatusCode::BAD_GATEWAY,
        kind: "upstream_error",
        message: format!(
            "This job was started {runs} times without finishing (each run was cut short, or no node could take it); it is not started again."
        ),
    })
}

/// The key that submitted the job, if it may still be used: neither revoked (nor
/// gone) nor expired.
async fn owner(state: &AppState, key_id: i64) -> Result<Arc<KeyRecord>, Refusal> {
    let mut key = state.keys().by_id(key_id);
    if key.is_none() {
        // Created on another replica a moment ago: the change feed has it.
        let _ = state.keys().pull().await;
        key = state.keys().by_id(key_id);
    }
    match key {
        Some(key) if !key.is_active() => Err(Refusal::Revoked),
        Some(key) if key.is_expired(now_unix()) => Err(Refusal::Expired {
            at: key.expires_at.unwrap_or_default(),
        }),
        Some(key) => Ok(key),
        None => Err(Refusal::Revoked),
    }
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
        Stop::Answered(Answered::Failed {
            error,
            not_sent: true,
        }) if job.attempts < i64::from(state.config().jobs.max_attempts) => {
            metrics.job_run("retried");
            let attempt = u32::try_from(job.attempts).unwrap_or(u32::MAX);
            let pause = RETRY.after(attempt);
            let due = now.saturating_add(i64::try_from(pause.as_millis()).unwrap_or(i64::MAX));
            tracing::info!(job_id = %job.id, attempt, code = error.code(), "job never reached a node; retrying later");
            if let Err(err) = jobs.requeue(&job.id, job.attempts, due, now).await {
                tracing::warn!(job_id = %job.id, error = %err, "could not queue a job again");
            }
            return;
        }
        Stop::Cancelled => store::JobOutcome {
            status: JobStatus::Cancelled,
            result: None,
            result_status: None,
            error_code: None,
            prompt_tokens: None,
            completion_tokens: None,
            charge: None,
        },
        Stop::Answered(Answered::Succeeded(body, prompt_tokens, completion_tokens)) => {
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
            store::JobOutcome {
                status: JobStatus::Succeeded,
                result: Some(body.to_vec()),
                result_status: Some(200),
                error_code: None,
                prompt_tokens,
                completion_tokens,
                charge,
            }
        }
        Stop::Answered(Answered::Failed { error, .. }) => {
            let request_id = format!("{}.{}", job.id, job.attempts);
            store::JobOutcome {
                status: JobStatus::Failed,
                result: Some(error.body().envelope_json(&request_id)),
                result_status: Some(error.status().as_u16()),
                error_code: Some(error.code().to_owned()),
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
