//! Collecting jobs: `GET /v1/harvest/{id}?wait=S` (a long-poll of up to 60 s),
//! `GET /v1/harvest` (the key's jobs, newest first) and `DELETE /v1/harvest/{id}`
//! (cancel). Only the key that submitted a job sees it: another key's job is a 404.

use std::time::Duration;

use axum::Extension;
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use super::job_view::JobView;
use crate::contract::{MAX_HARVEST_WAIT_SECS, X_ACS_LONGPOLL};
use crate::error::ApiError;
use crate::http::auth::Caller;
use crate::state::AppState;
use crate::store::{JobQuery, JobRow, JobStatus, StoreError, now_unix_ms};

/// A declined long-poll is told to come back after 1 to this many seconds, at random,
/// so that declined pollers do not return in one wave.
const DECLINED_RETRY_MAX_SECS: u64 = 5;
/// Jobs per page of `GET /v1/harvest` unless `limit` says otherwise, and the most.
const DEFAULT_PAGE: u32 = 20;
const MAX_PAGE: u32 = 100;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct HarvestParams {
    /// Seconds to wait for the job to end, 0 to 60 (default 0: answer at once).
    wait: Option<String>,
}

#[utoipa::path(
    get,
    path = "/v1/harvest/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "The job's id (`job_…`), as in the submission's `Location`."), HarvestParams),
    responses(
        (status = 200, description = "The job. When it has not ended and `wait` > 0, the answer comes when it ends or `wait` seconds pass, whichever is first. When too many long-polls already wait (this server's `jobs.max_waiters`, or the key's `jobs.max_waiters_per_key`), the answer comes at once with `X-Acs-Longpoll: declined` and a `Retry-After`: not an error, poll again then.", body = crate::http::openapi::JobDoc,
            headers(
                ("X-Acs-Longpoll" = String, description = "`declined`: answered early because too many long-polls were waiting."),
                ("Retry-After" = u32, description = "With `X-Acs-Longpoll: declined`: seconds to wait before polling again (1–5, jittered)."),
            )),
        (status = 400, description = "`invalid_request`: `wait` is not an integer from 0 to 60.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 404, description = "`job_not_found`: no job of this key has this id (another key's job included), or it was deleted 7 days after it ended.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`: the job store cannot be reached. Carries `Retry-After`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = []))
)]
pub async fn harvest(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Query(params): Query<HarvestParams>,
) -> Result<Response, ApiError> {
    let wait = wait_secs(params.wait.as_deref())?;
    let key = caller.0.id;
    let row = own_job(&state, key, &id).await?;
    if row.status().is_terminal() || wait == 0 {
        return Ok(Json(JobView::of(&row, &state.config().jobs)).into_response());
    }
    let Ok(waiter) = state.jobs().wait_for(key, &id) else {
        state.metrics().harvest_declined();
        let mut response = Json(JobView::of(&row, &state.config().jobs)).into_response();
        let retry_after = rand::rng().random_range(1..=DECLINED_RETRY_MAX_SECS);
        let headers = response.headers_mut();
        headers.insert(X_ACS_LONGPOLL, HeaderValue::from_static("declined"));
        headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
        return Ok(response);
    };
    {
        let _waiting = state.metrics().harvest_waiting();
        let ended = waiter.ended().notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        // Read again once listening: an end between the first read and now is not missed.
        let row = own_job(&state, key, &id).await?;
        if !row.status().is_terminal() {
            tokio::select! {
                () = ended => {}
                () = tokio::time::sleep(Duration::from_secs(wait)) => {}
                () = state.jobs().stopping().cancelled() => {}
            }
        }
    }
    drop(waiter);
    let row = own_job(&state, key, &id).await?;
    Ok(Json(JobView::of(&row, &state.config().jobs)).into_response())
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Only jobs with this status.
    status: Option<JobStatus>,
    /// The `last_id` of the previous page: only jobs submitted before it.
    after: Option<String>,
    /// Jobs per page, 1 to 100 (default 20).
    limit: Option<u32>,
}

#[derive(Debug, Serialize)]
struct JobPage<'a> {
    object: &'static str,
    data: Vec<JobView<'a>>,
    first_id: Option<&'a str>,
    last_id: Option<&'a str>,
    has_more: bool,
}

#[utoipa::path(
    get,
    path = "/v1/harvest",
    tag = "jobs",
    params(ListParams),
    responses(
        (status = 200, description = "The calling key's jobs, newest first, a page at a time: `{\"object\":\"list\",\"data\":[job…],\"first_id\",\"last_id\",\"has_more\"}`; pass `last_id` as `after` for the next page. The jobs carry no `result` (harvest a job for it); a failed job's `error` is there.", body = crate::http::openapi::JobPageDoc),
        (status = 400, description = "`invalid_request`: an unknown parameter or status, or `limit` outside 1–100.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`. Carries `Retry-After`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = []))
)]
pub async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(params): Query<ListParams>,
) -> Result<Response, ApiError> {
    let limit = params.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid_param(
            "limit",
            format!("limit must be from 1 to {MAX_PAGE} (got {limit})."),
        ));
    }
    let query = JobQuery {
        key_id: Some(caller.0.id),
        status: params.status,
        after: params.after,
        limit: limit + 1,
    };
    let mut rows = state
        .store()
        .jobs()
        .list(&query)
        .await
        .map_err(unavailable)?;
    let has_more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    let settings = &state.config().jobs;
    let page = JobPage {
        object: "list",
        data: rows.iter().map(|row| JobView::of(row, settings)).collect(),
        first_id: rows.first().map(|row| row.id.as_str()),
        last_id: rows.last().map(|row| row.id.as_str()),
        has_more,
    };
    Ok(Json(page).into_response())
}

#[utoipa::path(
    delete,
    path = "/v1/harvest/{id}",
    tag = "jobs",
    params(("id" = String, Path, description = "The job's id.")),
    responses(
        (status = 200, description = "The job after the cancel: a queued job is `cancelled` and never runs; a running one is stopped upstream at once and ends `cancelled`, charged for what it used (its status reads `running` with `cancel_requested: true` until then; harvest with `wait` to see it end). A job that has ended is left as it is.", body = crate::http::openapi::JobDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 404, description = "`job_not_found`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`. Carries `Retry-After`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = []))
)]
pub async fn cancel(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let row = state
        .store()
        .jobs()
        .cancel(caller.0.id, &id, now_unix_ms())
        .await
        .map_err(unavailable)?
        .ok_or_else(|| not_found(&id))?;
    match row.status() {
        JobStatus::Cancelled => state.jobs().ended(&id),
        // Its worker, if it is here, stops now; one elsewhere sees the flag at its
        // next lease renewal.
        JobStatus::Running => state.jobs().cancel_here(&id),
        _ => {}
    }
    tracing::info!(job_id = %id, status = row.status().as_str(), "job cancel asked");
    Ok(Json(JobView::of(&row, &state.config().jobs)).into_response())
}

/// The caller's job, or 404.
async fn own_job(state: &AppState, key: i64, id: &str) -> Result<JobRow, ApiError> {
    state
        .store()
        .jobs()
        .job(key, id)
        .await
        .map_err(unavailable)?
        .ok_or_else(|| not_found(id))
}

fn not_found(id: &str) -> ApiError {
    ApiError::JobNotFound(id.chars().take(64).collect())
}

fn unavailable(err: StoreError) -> ApiError {
    ApiError::store_unavailable(&err, "a job request")
}

/// `wait` in seconds: an integer from 0 to 60; absent is 0.
fn wait_secs(wait: Option<&str>) -> Result<u64, ApiError> {
    let Some(text) = wait else { return Ok(0) };
    match text.parse::<u64>() {
        Ok(secs) if secs <= MAX_HARVEST_WAIT_SECS => Ok(secs),
        _ => Err(ApiError::invalid_param(
            "wait",
            format!(
                "wait must be an integer number of seconds from 0 to {MAX_HARVEST_WAIT_SECS} (got '{}').",
                text.chars().take(32).collect::<String>()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::wait_secs;

    #[test]
    fn wait_is_zero_to_sixty_whole_seconds() {
        assert_eq!(wait_secs(None).unwrap(), 0);
        assert_eq!(wait_secs(Some("0")).unwrap(), 0);
        assert_eq!(wait_secs(Some("60")).unwrap(), 60);
        for bad in ["61", "-1", "1.5", "", "ten"] {
            assert!(wait_secs(Some(bad)).is_err(), "{bad}");
        }
    }
}
