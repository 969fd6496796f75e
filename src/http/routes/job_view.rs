//! The job object clients see: `GET /v1/harvest/{id}`, the answer to a submission, and
//! the items of `GET /v1/harvest`. Its `result` is the exact body vLLM produced and its
//! `error` the exact envelope a synchronous call would have got, embedded as they are
//! (a list's rows carry no result: `JobStore::list` does not read it);
//! a job cancelled or expired has an envelope saying so (`job_cancelled`,
//! `job_expired`).

use serde::Serialize;
use serde_json::value::RawValue;

use crate::config::JobSettings;
use crate::error::ErrorBody;
use crate::store::{JobRow, JobStatus};

/// `object` of a job.
pub const OBJECT: &str = "completion.job";

#[derive(Debug, Serialize)]
pub struct JobView<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub status: JobStatus,
    pub model: &'a str,
    /// Unix seconds.
    pub created_at: i64,
    pub started_at: Option<i64>,
    pub finished_at: Option<i64>,
    /// While queued: when the job expires unless it has started. Once ended: when its
    /// request and result are deleted.
    pub expires_at: Option<i64>,
    /// Runs started.
    pub attempts: i64,
    /// A cancel was asked for while it runs; it ends as `cancelled` shortly.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cancel_requested: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Box<RawValue>>,
}

impl<'a> JobView<'a> {
    pub fn of(row: &'a JobRow, settings: &JobSettings) -> Self {
        let status = row.status();
        let content_ttl = i64::try_from(settings.content_ttl_ms).unwrap_or(i64::MAX);
        let expires_at_ms = match status {
            JobStatus::Queued => Some(row.expires_at_ms),
            JobStatus::Running => None,
            _ => row.finished_at_ms.map(|at| at.saturating_add(content_ttl)),
        };
        // Stored by the worker as JSON it checked; anything else is left out.
        let body = row
            .result
            .as_deref()
            .and_then(|bytes| std::str::from_utf8(bytes).ok())
            .and_then(|text| serde_json::from_str::<&RawValue>(text).ok());
        let succeeded = status == JobStatus::Succeeded;
        let error = match status {
            JobStatus::Failed => body.map(RawValue::to_owned),
            // Ended without a run's answer: an envelope that says how.
            JobStatus::Cancelled | JobStatus::Expired => ended_without_answer(row, status),
            _ => None,
        };
        Self {
            id: &row.id,
            object: OBJECT,
            status,
            model: &row.model,
            created_at: seconds(row.created_at_ms),
            started_at: row.started_at_ms.map(seconds),
            finished_at: row.finished_at_ms.map(seconds),
            expires_at: expires_at_ms.map(seconds),
            attempts: row.attempts,
            cancel_requested: status == JobStatus::Running && row.cancel_requested != 0,
            result: body.filter(|_| succeeded),
            error,
        }
    }
}

/// The envelope of a job cancelled or expired (`job_cancelled`, `job_expired`), with
/// the job's id as its request id.
fn ended_without_answer(row: &JobRow, status: JobStatus) -> Option<Box<RawValue>> {
    let (code, message) = match status {
        JobStatus::Cancelled => (
            "job_cancelled",
            "The job was cancelled (DELETE /v1/harvest/{id}) before it produced a result.",
        ),
        _ => (
            "job_expired",
            "The job was still queued when it expired (24 hours after its submission); it never ran.",
        ),
    };
    let error = ErrorBody {
        code,
        message: message.to_owned(),
        kind: "invalid_request_error",
        param: None,
    };
    RawValue::from_string(String::from_utf8(error.envelope_json(&row.id)).ok()?).ok()
}

fn seconds(ms: i64) -> i64 {
    ms.div_euclid(1000)
}
