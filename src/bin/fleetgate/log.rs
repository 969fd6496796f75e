//! `fleetgate log` (recent requests from the request metadata log, filtered) and
//! `fleetgate spend` (requests and tokens per UTC day, key and model). Both read the
//! store the config names; neither shows anything but metadata (the log holds no prompt
//! or completion text).

use std::fmt::Write as _;

use anyhow::{Context as _, bail};
use serde_json::json;

use fleetgate::config::LimitDefaults;
use fleetgate::keys::KeyService;
use fleetgate::store::{RequestLogRow, RequestQuery, SpendQuery, SpendRow, StatusMatch, Store};

/// The most rows `fleetgate log` prints at once.
pub const MAX_LOG_ROWS: u32 = 10_000;

const DAY_MS: i64 = 86_400_000;

/// What `log` and `spend` select by; times are Unix milliseconds.
pub struct Selection<'a> {
    pub key: Option<&'a str>,
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
}

/// The key id of `id_or_prefix`, if one was given.
async fn key_id(
    store: &dyn Store,
    defaults: &LimitDefaults,
    id_or_prefix: Option<&str>,
) -> anyhow::Result<Option<i64>> {
    match id_or_prefix {
        None => Ok(None),
        Some(wanted) => Ok(Some(
            KeyService::new(store, defaults).find(wanted).await?.id,
        )),
    }
}

/// `fleetgate log`: the newest `limit` requests that match, newest first.
pub async fn log(
    store: &dyn Store,
    defaults: &LimitDefaults,
    selection: &Selection<'_>,
    model: Option<String>,
    status: Option<StatusMatch>,
    limit: u32,
    as_json: bool,
) -> anyhow::Result<String> {
    let query = RequestQuery {
        key_id: key_id(store, defaults, selection.key).await?,
        model,
        status,
        since_ms: selection.since_ms,
        until_ms: selection.until_ms,
        limit,
    };
    let rows = store
        .requests(&query)
        .await
        .context("reading the request log")?;
    if as_json {
        return Ok(rows
            .iter()
            .map(|r| row_json(r).to_string())
            .collect::<Vec<_>>()
            .join("\n"));
    }
    Ok(log_table(&rows))
}

fn row_json(row: &RequestLogRow) -> serde_json::Value {
    json!({
        "request_id": row.request_id,
        "time": timestamp(row.created_at_ms),
        "created_at_ms": row.created_at_ms,
        "key_id": row.key_id,
        "key_prefix": row.key_prefix,
        "email": row.email,
        "client_ip": row.client_ip.map(|ip| ip.to_string()),
        "endpoint": row.endpoint,
        "model": row.model,
        "status": row.status,
        "error_code": row.error_code,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "latency_ms": row.latency_ms,
        "queue_wait_ms": row.queue_wait_ms,
        "workload": row.workload,
    })
}

fn log_table(rows: &[RequestLogRow]) -> String {
    if rows.is_empty() {
        return "No requests match.".to_owned();
    }
    let mut out = format!(
        "{:<24}  {:<36}  {:<12}  {:<16}  {:>6}  {:<22}  {:>8}  {:>10}  {:>9}\n",
        "TIME (UTC)",
        "REQUEST",
        "KEY",
        "MODEL",
        "STATUS",
        "CODE",
        "PROMPT",
        "COMPLETION",
        "LATENCY"
    );
    let count = |tokens: Option<u64>| tokens.map_or_else(|| "-".to_owned(), |t| t.to_string());
    for row in rows {
        let _ = writeln!(
            out,
            "{:<24}  {:<36}  {:<12}  {:<16}  {:>6}  {:<22}  {:>8}  {:>10}  {:>6} ms",
            timestamp(row.created_at_ms),
            row.request_id,
            row.key_prefix.as_deref().unwrap_or("-"),
            row.model.as_deref().unwrap_or("-"),
            row.status,
            row.error_code.as_deref().unwrap_or(""),
            count(row.prompt_tokens),
            count(row.completion_tokens),
            row.latency_ms,
        );
    }
    let _ = write!(out, "{} requests, newest first.", rows.len());
    out
}

/// `fleetgate spend`: per UTC day, key and model, then the totals.
pub async fn spend(
    store: &dyn Store,
    defaults: &LimitDefaults,
    selection: &Selection<'_>,
    as_json: bool,
) -> anyhow::Result<String> {
    let query = SpendQuery {
        key_id: key_id(store, defaults, selection.key).await?,
        since_ms: selection.since_ms,
        until_ms: selection.until_ms,
    };
    let rows = store
        .spend(&query)
        .await
        .context("reading the request log")?;
    if as_json {
        let days: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "day": day(r.day),
                    "key_id": r.key_id,
                    "key_prefix": r.key_prefix,
                    "model": r.model,
                    "requests": r.requests,
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens,
                    "total_tokens": r.prompt_tokens + r.completion_tokens,
                })
            })
            .collect();
        return Ok(json!(days).to_string());
    }
    Ok(spend_table(&rows))
}

fn spend_table(rows: &[SpendRow]) -> String {
    if rows.is_empty() {
        return "No requests in this period.".to_owned();
    }
    let line = |day: &str, key: &str, model: &str, requests: u64, prompt: u64, completion: u64| {
        format!(
            "{day:<10}  {key:<12}  {model:<16}  {requests:>8}  {prompt:>12}  {completion:>12}  {:>12}\n",
            prompt + completion
        )
    };
    let mut out = format!(
        "{:<10}  {:<12}  {:<16}  {:>8}  {:>12}  {:>12}  {:>12}\n",
        "DAY (UTC)", "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL"
    );
    let (mut requests, mut prompt, mut completion) = (0, 0, 0);
    for row in rows {
        out.push_str(&line(
            &day(row.day),
            row.key_prefix.as_deref().unwrap_or("-"),
            row.model.as_deref().unwrap_or("-"),
            row.requests,
            row.prompt_tokens,
            row.completion_tokens,
        ));
        requests += row.requests;
        prompt += row.prompt_tokens;
        completion += row.completion_tokens;
    }
    out.push_str(&line("total", "", "", requests, prompt, completion));
    out.push_str(
        "From the request log (metadata of every request); the budget itself is counted in\n\
         the usage ledger (`fleetgate keys usage`).",
    );
    out
}

/// `200`, or a class: `2xx`, `4xx`, `5xx`.
pub fn status_arg(value: &str) -> Result<StatusMatch, String> {
    if let Some(class) = value
        .strip_suffix("xx")
        .or_else(|| value.strip_suffix("XX"))
    {
        return match class.parse::<u16>() {
            Ok(class @ 1..=5) => Ok(StatusMatch::Class(class)),
            _ => Err(format!("a status class is 1xx to 5xx (got '{value}')")),
        };
    }
    match value.parse::<u16>() {
        Ok(status @ 100..=599) => Ok(StatusMatch::Exact(status)),
        _ => Err(format!(
            "a status is 100 to 599, or a class such as 4xx (got '{value}')"
        )),
    }
}

/// A time: how long ago (`90s`, `15m`, `2h`, `7d`), a UTC day (`2026-12-01`) or a UTC
/// time (`2026-12-01T10:30:00Z`, seconds optional). `now_ms` is the present.
pub fn time_arg(value: &str, now_ms: i64) -> Result<i64, String> {
    if let Some(ago) = ago_ms(value) {
        return Ok(now_ms - ago);
    }
    utc_ms(value).ok_or_else(|| {
        format!("expected a time ago (90s, 15m, 2h, 7d), a UTC day (2026-12-01) or a UTC time (2026-12-01T10:30:00Z), got '{value}'")
    })
}

fn ago_ms(value: &str) -> Option<i64> {
    i64::try_from(fleetgate::times::parse_duration(value)?)
        .ok()?
        .checked_mul(1_000)
}

/// A UTC day or an RFC 3339 time (a fraction of a second dropped).
fn utc_ms(value: &str) -> Option<i64> {
    fleetgate::times::parse_time(value)?.checked_mul(1_000)
}

/// `2026-12-01T10:30:00.123Z`.
fn timestamp(unix_ms: i64) -> String {
    let Ok(at) = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(unix_ms) * 1_000_000)
    else {
        return unix_ms.to_string();
    };
    format!(
        "{}T{:02}:{:02}:{:02}.{:03}Z",
        at.date(),
        at.hour(),
        at.minute(),
        at.second(),
        at.millisecond()
    )
}

/// Days since 1970-01-01 as `2026-12-01`.
fn day(days: i64) -> String {
    timestamp(days.saturating_mul(DAY_MS))[..10].to_owned()
}

/// Refuses `--since` after `--until`.
pub fn check_range(since_ms: Option<i64>, until_ms: Option<i64>) -> anyhow::Result<()> {
    if let (Some(since), Some(until)) = (since_ms, until_ms)
        && since >= until
    {
        bail!("--since must be before --until");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_764_672_000_000; // 2025-12-02T10:40:00Z

    #[test]
    fn times_are_ago_days_or_utc_times() {
        assert_eq!(time_arg("90s", NOW), Ok(NOW - 90_000));
        assert_eq!(time_arg("15m", NOW), Ok(NOW - 900_000));
        assert_eq!(time_arg("2h", NOW), Ok(NOW - 7_200_000));
        assert_eq!(time_arg("7d", NOW), Ok(NOW - 7 * DAY_MS));
        assert_eq!(time_arg("2025-12-02", NOW), Ok(1_764_633_600_000));
        assert_eq!(time_arg("2025-12-02T10:40Z", NOW), Ok(NOW));
        assert_eq!(time_arg("2025-12-02T10:40:00Z", NOW), Ok(NOW));
        for bad in [
            "",
            "h",
            "-1d",
            "3w",
            "2025-13-01",
            "2025-02-30",
            "2025-12-02T10:40",
            "yesterday",
        ] {
            assert!(time_arg(bad, NOW).is_err(), "{bad}");
        }
    }

    #[test]
    fn statuses_are_exact_or_a_class() {
        assert_eq!(status_arg("200"), Ok(StatusMatch::Exact(200)));
        assert_eq!(status_arg("4xx"), Ok(StatusMatch::Class(4)));
        assert_eq!(status_arg("5XX"), Ok(StatusMatch::Class(5)));
        for bad in ["0", "99", "600", "6xx", "0xx", "x", "4x"] {
            assert!(status_arg(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn times_print_as_utc() {
        assert_eq!(timestamp(NOW + 123), "2025-12-02T10:40:00.123Z");
        assert_eq!(day(NOW / DAY_MS), "2025-12-02");
    }
}
