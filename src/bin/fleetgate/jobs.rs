//! `fleetgate jobs list|show|cancel`: completion jobs as the store has them, for the
//! operator (any key's jobs). Shows metadata only: never a job's request or result.

use std::collections::HashMap;
use std::fmt::Write as _;

use anyhow::{Context as _, bail};
use serde_json::json;

use fleetgate::config::LimitDefaults;
use fleetgate::keys::KeyService;
use fleetgate::store::{JobQuery, JobRow, JobStatus, Store, now_unix_ms};

/// The most jobs `fleetgate jobs list` prints at once.
pub const MAX_LIST: u32 = 1_000;

/// A job status flag: one of the job statuses.
pub fn status_arg(value: &str) -> Result<JobStatus, String> {
    JobStatus::parse(value).ok_or_else(|| {
        let names: Vec<_> = JobStatus::ALL.iter().map(|s| s.as_str()).collect();
        format!("expected one of {}", names.join(", "))
    })
}

/// `fleetgate jobs list`: the newest `limit` jobs, of one key or all.
pub async fn list(
    store: &dyn Store,
    defaults: &LimitDefaults,
    key: Option<&str>,
    status: Option<JobStatus>,
    limit: u32,
    as_json: bool,
) -> anyhow::Result<String> {
    let key_id = match key {
        Some(wanted) => Some(KeyService::new(store, defaults).find(wanted).await?.id),
        None => None,
    };
    let query = JobQuery {
        key_id,
        status,
        after: None,
        limit,
    };
    let rows = store
        .jobs()
        .list(&query)
        .await
        .context("reading the jobs")?;
    // Keys by their prefix, as `fleetgate log` shows them: the id alone means nothing
    // to whoever reads `keys list` or a client's configuration.
    let prefixes: HashMap<i64, String> = KeyService::new(store, defaults)
        .list()
        .await?
        .into_iter()
        .map(|key| (key.id, key.prefix))
        .collect();
    let prefix = |row: &JobRow| prefixes.get(&row.key_id).map(String::as_str);
    if as_json {
        return Ok(rows
            .iter()
            .map(|row| metadata(row, prefix(row)).to_string())
            .collect::<Vec<_>>()
            .join("\n"));
    }
    if rows.is_empty() {
        return Ok("No jobs match.".to_owned());
    }
    let mut out = format!(
        "{:<36}  {:<12}  {:<16}  {:<10}  {:>8}  {:<16}\n",
        "JOB", "KEY", "MODEL", "STATUS", "ATTEMPTS", "CODE"
    );
    for row in &rows {
        let _ = writeln!(
            out,
            "{:<36}  {:<12}  {:<16}  {:<10}  {:>8}  {:<16}",
            row.id,
            prefix(row).unwrap_or("-"),
            row.model,
            row.status,
            row.attempts,
            row.error_code.as_deref().unwrap_or("-")
        );
    }
    Ok(out.trim_end().to_owned())
}

/// `fleetgate jobs show`: one job's metadata as JSON.
pub async fn show(store: &dyn Store, id: &str) -> anyhow::Result<String> {
    let row = find(store, id).await?;
    let key = store
        .key(&row.key_id.to_string())
        .await
        .context("reading the job's key")?;
    let prefix = key.as_ref().map(|key| key.prefix.as_str());
    Ok(serde_json::to_string_pretty(&metadata(&row, prefix))?)
}

/// `fleetgate jobs cancel`: a queued job is cancelled at once; a running one is
/// stopped by its worker within about a second.
pub async fn cancel(store: &dyn Store, id: &str) -> anyhow::Result<String> {
    let row = find(store, id).await?;
    let row = store
        .jobs()
        .cancel(row.key_id, id, now_unix_ms())
        .await
        .context("cancelling the job")?
        .with_context(|| format!("no job with id '{id}'"))?;
    Ok(match row.status() {
        JobStatus::Cancelled => format!("Cancelled {id}."),
        JobStatus::Running => {
            format!("Cancel asked: {id} is stopped by its worker within about a second.")
        }
        other => format!(
            "{id} has already ended ({}); nothing to cancel.",
            other.as_str()
        ),
    })
}

async fn find(store: &dyn Store, id: &str) -> anyhow::Result<JobRow> {
    match store.jobs().any_job(id).await.context("reading the job")? {
        Some(row) => Ok(row),
        None => bail!("no job with id '{id}'"),
    }
}

/// What the CLI shows of a job: never its request or result. `key_prefix` is that of
/// the job's key (`null` if the store has no such key).
fn metadata(row: &JobRow, key_prefix: Option<&str>) -> serde_json::Value {
    json!({
        "id": row.id,
        "key_id": row.key_id,
        "key_prefix": key_prefix,
        "model": row.model,
        "status": row.status,
        "idempotency_key": row.idempotency_key,
        "attempts": row.attempts,
        "lease_owner": row.lease_owner,
        "cancel_requested": row.cancel_requested != 0,
        "error_code": row.error_code,
        "result_status": row.result_status,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "content_kept": row.request.is_some() || row.result.is_some(),
        "created_at_ms": row.created_at_ms,
        "started_at_ms": row.started_at_ms,
        "finished_at_ms": row.finished_at_ms,
        "expires_at_ms": row.expires_at_ms,
    })
}
