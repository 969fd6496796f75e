//! Submitting a completion job (`POST /v1/completions` with `Prefer: respond-async`).
//!
//! The request is checked and admitted exactly as a synchronous one would be (every
//! 400/401/413/429 is decided here, and the submission counts as a start against the
//! key's rate), and held to the key's bounds on pending jobs (how many, and their
//! request bytes), then stored; the front door answers `202 Accepted` with its
//! `Location`. Its run is admitted again when a worker takes it (slots and budget, as
//! any request). With an idempotency key, a retry with the same body gets the job
//! already submitted and one with another body `idempotency_key_reused`, before any
//! admission.

use sha2::{Digest, Sha256};
use std::time::Duration;

use crate::completion::pipeline::{self, Checked};
use crate::error::ApiError;
use crate::state::AppState;
use crate::store::{Inserted, JobRow, KeyRecord, NewJob, now_unix_ms};

/// Suggested wait after the key's pending jobs reached their bound.
const PENDING_RETRY_AFTER: Duration = Duration::from_secs(5);

/// A stored job: new, or the one already submitted under the same idempotency key
/// with the same body.
pub struct Submitted {
    pub row: JobRow,
    pub created: bool,
}

/// Stores the checked request (`body`) as a job of `owner`.
pub async fn submit(
    state: &AppState,
    owner: &KeyRecord,
    request_id: &str,
    idempotency_key: Option<String>,
    body: &[u8],
    checked: Checked<'_, '_>,
) -> Result<Submitted, ApiError> {
    if checked.request.stream() {
        return Err(ApiError::invalid_param(
            "stream",
            "A job's result is one JSON body: leave stream out (or false) with Prefer: respond-async.",
        ));
    }
    let request_hash = Sha256::digest(body).to_vec();
    let key = owner.id;
    let jobs = state.store().jobs();
    let unavailable =
        |err: crate::store::StoreError| ApiError::store_unavailable(&err, "a job submission");
    if let Some(ikey) = &idempotency_key
        && let Some(existing) = jobs
            .by_idempotency_key(key, ikey)
            .await
            .map_err(unavailable)?
    {
        return repeated(existing, &request_hash, ikey);
    }
    let settings = &state.config().jobs;
    let pending = jobs.pending(key).await.map_err(unavailable)?;
    if pending.jobs >= u64::from(settings.max_pending_per_key) {
        return Err(ApiError::JobsPending {
            pending: pending.jobs,
            retry_after: PENDING_RETRY_AFTER,
        });
    }
    // Two submissions of one key at once may both pass: the bound is exceeded by at
    // most the key's concurrent submissions, each within `max_body_bytes`.
    let request_bytes = u64::try_from(body.len()).unwrap_or(u64::MAX);
    if pending.bytes.saturating_add(request_bytes) > settings.max_pending_bytes_per_key {
        return Err(ApiError::JobsPendingBytes {
            pending_bytes: pending.bytes,
            request_bytes: body.len(),
            limit: settings.max_pending_bytes_per_key,
            retry_after: PENDING_RETRY_AFTER,
        });
    }
    let window = Some(Duration::from_millis(settings.run_timeout_ms));
    pipeline::admissible(state, owner, request_id, &checked, window).await?;
    let now_ms = now_unix_ms();
    let job = NewJob {
        id: format!("job_{}", uuid::Uuid::now_v7().simple()),
        key_id: key,
        model: checked.model.id.clone(),
        idempotency_key: idempotency_key.clone(),
        request_hash: request_hash.clone(),
        request: body.to_vec(),
        created_at_ms: now_ms,
        expires_at_ms: now_ms
            .saturating_add(i64::try_from(settings.queued_ttl_ms).unwrap_or(i64::MAX)),
    };
    match jobs.insert(&job).await.map_err(unavailable)? {
        Inserted::Created(row) => {
            state.jobs().job_queued();
            tracing::info!(job_id = %row.id, request_id, model = %row.model, "job submitted");
            Ok(Submitted { row, created: true })
        }
        // The same key's concurrent submission under this idempotency key won.
        Inserted::Existing(row) => {
            repeated(row, &request_hash, idempotency_key.as_deref().unwrap_or(""))
        }
    }
}

/// A submission whose idempotency key is taken: the job when the body is the same,
/// else 422.
fn repeated(
    existing: JobRow,
    request_hash: &[u8],
    idempotency_key: &str,
) -> Result<Submitted, ApiError> {
    if existing.request_hash != request_hash {
        return Err(ApiError::IdempotencyKeyReused(idempotency_key.to_owned()));
    }
    Ok(Submitted {
        row: existing,
        created: false,
    })
}
