//! One metadata row per request for the request log (what `docs/operations.md`
//! promises): who (key prefix, email, client IP), what (endpoint, model, workload), how
//! it went (status, error code, tokens, latency) — never prompt or completion text.
//!
//! The front door opens a record for each API request (`http::every_request`), a job's
//! run opens one for each try; the stages fill in the rest as they learn it. A
//! completion whose body is still streaming holds the record open: the row is written
//! when the last holder lets go, so streams are logged with their final token counts
//! and full latency. The request metrics are counted at the same moment, from the same
//! row.
//!
//! A request refused before anybody was authenticated (no key, a bad one, a route that
//! does not exist: a 4xx without a caller) is noise anyone can send by the thousand: it
//! is counted (`fleetgate_unauthenticated_refusals_total`), but only a sample of it,
//! one a second, is logged and recorded, with how many were left out since
//! ([`RequestLog::sample_unauthenticated`]). So noise costs neither a log line nor a
//! row apiece, and never crowds the served requests' rows out of the log's queue.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::contract::Workload;
use crate::metrics::{FinishedRequest, Metrics};
use crate::request_log::RequestLog;
use crate::state::AppState;
use crate::store::{RequestLogRow, now_unix_ms};

/// The open record of the current request, shared by the stages that fill it in.
#[derive(Clone)]
pub struct RequestRecord(Arc<Mutex<Open>>);

struct Open {
    row: RequestLogRow,
    started: Instant,
    /// Parties that must let go before the row is written.
    holders: u8,
    /// A key or the admin token was shown (see [`RequestRecord::set_authenticated`]).
    authenticated: bool,
    log: RequestLog,
    metrics: Metrics,
    /// The request's span (see `http::every_request`), entered to write the line: a
    /// stream's row is written when its body ends, after the handler's span has been
    /// left.
    span: tracing::Span,
}

impl RequestRecord {
    /// Opens a record; the row is written when its last holder lets go (the opener is
    /// the first).
    pub fn open(
        state: &AppState,
        request_id: String,
        endpoint: String,
        workload: Option<Workload>,
        client_ip: Option<std::net::IpAddr>,
    ) -> Self {
        Self(Arc::new(Mutex::new(Open {
            row: RequestLogRow {
                request_id,
                created_at_ms: now_unix_ms(),
                key_id: None,
                key_prefix: None,
                email: None,
                client_ip,
                endpoint,
                model: None,
                prompt_tokens: None,
                completion_tokens: None,
                status: 0,
                error_code: None,
                latency_ms: 0,
                workload: workload.map(|w| w.as_str().to_owned()),
                queue_wait_ms: None,
            },
            started: Instant::now(),
            holders: 1,
            authenticated: false,
            log: state.request_log().clone(),
            metrics: state.metrics().clone(),
            span: tracing::Span::current(),
        })))
    }

    /// The outcome the row reports: the status sent and the error code, if any.
    pub fn set_outcome(&self, status: u16, error_code: Option<&str>) {
        let mut open = self.lock();
        open.row.status = status;
        open.row.error_code = error_code.map(str::to_owned);
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key the request was made with (which authenticates it).
    pub fn set_caller(&self, key_id: i64, key_prefix: &str, email: Option<&str>) {
        let mut open = self.lock();
        open.authenticated = true;
        open.row.key_id = Some(key_id);
        open.row.key_prefix = Some(key_prefix.to_owned());
        open.row.email = email.map(str::to_owned);
    }

    /// The request showed a credential that names no key: the admin token.
    pub fn set_authenticated(&self) {
        self.lock().authenticated = true;
    }

    pub fn set_model(&self, model: &str) {
        self.lock().row.model = Some(model.to_owned());
    }

    /// Adds a wait for the request's turn (its key's queue, its model's fleet queue).
    pub fn add_queue_wait(&self, waited: Duration) {
        let ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        let mut open = self.lock();
        open.row.queue_wait_ms = Some(open.row.queue_wait_ms.unwrap_or(0).saturating_add(ms));
    }

    pub fn set_tokens(&self, prompt_tokens: u64, completion_tokens: u64) {
        let mut open = self.lock();
        open.row.prompt_tokens = Some(prompt_tokens);
        open.row.completion_tokens = Some(completion_tokens);
    }

    /// An error that went into the body of a 200 already sent (after a cold boot).
    pub fn set_in_body_error(&self, code: &str) {
        self.lock().row.error_code = Some(code.to_owned());
    }

    /// Keeps the record open until [`RequestRecord::release`] is called again (by the
    /// body that is still streaming).
    pub fn hold(&self) {
        self.lock().holders += 1;
    }

    /// Lets go; the last holder writes the row.
    pub fn release(&self) {
        let mut open = self.lock();
        open.holders = open.holders.saturating_sub(1);
        if open.holders == 0 {
            let latency = open.started.elapsed();
            open.row.latency_ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
            open.metrics.request_finished(&FinishedRequest {
                model: open.row.model.as_deref(),
                status: open.row.status,
                error_code: open.row.error_code.as_deref(),
                prompt_tokens: open.row.prompt_tokens,
                completion_tokens: open.row.completion_tokens,
                latency,
                queue_wait: open.row.queue_wait_ms.map(Duration::from_millis),
            });
            let left_out = if open.refused_unauthenticated() {
                open.metrics
                    .unauthenticated_refusal(open.row.error_code.as_deref());
                // Not the sample: neither a line nor a row.
                let Some(left_out) = open.log.sample_unauthenticated() else {
                    return;
                };
                Some(left_out)
            } else {
                None
            };
            open.span.in_scope(|| log_line(&open.row, left_out));
            open.log.record(open.row.clone());
        }
    }
}

impl Open {
    /// Refused (4xx) before a key or the admin token was shown: noise anybody can send.
    fn refused_unauthenticated(&self) -> bool {
        !self.authenticated && (400..500).contains(&self.row.status)
    }
}

/// One log line per API request, with the same metadata as its row (JSON with
/// `log_format = "json"`): never a key secret, a prompt or a completion. For the sample
/// of unauthenticated refusals, `unauthenticated_left_out` says how many such requests
/// since the last sample got no line.
fn log_line(row: &RequestLogRow, unauthenticated_left_out: Option<u64>) {
    tracing::info!(
        request_id = %row.request_id,
        endpoint = %row.endpoint,
        key_prefix = row.key_prefix.as_deref().unwrap_or(""),
        model = row.model.as_deref().unwrap_or(""),
        status = row.status,
        error_code = row.error_code.as_deref().unwrap_or(""),
        prompt_tokens = row.prompt_tokens.unwrap_or(0),
        completion_tokens = row.completion_tokens.unwrap_or(0),
        latency_ms = row.latency_ms,
        workload = row.workload.as_deref().unwrap_or(""),
        queue_wait_ms = row.queue_wait_ms,
        unauthenticated_left_out,
        "request finished"
    );
}
