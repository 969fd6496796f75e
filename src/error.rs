//! The one public error type. Every error any route returns is an [`ApiError`]: its
//! status, code, message and what it tells a client about retrying are decided here;
//! the front door renders it (`http::error_response` and the envelope of
//! `http::every_request`, which owns the request id) as the OpenAI-shaped body `{"error":{…},"request_id":…}`
//! ([`ErrorBody::envelope_json`]). No handler builds error JSON by hand.

use std::borrow::Cow;
use std::time::Duration;

use http::StatusCode;
use serde::Serialize;

/// How many characters of a received value an error message shows.
const EXCERPT_MAX_CHARS: usize = 40;

/// A received value as an error message shows it: at most [`EXCERPT_MAX_CHARS`]
/// characters, then `…`. A client's megabyte of text never comes back as an error.
pub fn excerpt(text: &str) -> String {
    match text.char_indices().nth(EXCERPT_MAX_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// How long a client should wait before retrying a retryable upstream failure.
const UPSTREAM_RETRY_AFTER: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A request that breaks a rule of the contract; `param` names the field when one is at fault.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<Cow<'static, str>>,
    },
    /// The model the request named, as an [`excerpt`].
    #[error("The model '{0}' does not exist. GET /v1/models lists the available ids.")]
    ModelNotFound(String),
    #[error(
        "POST /v1/chat/completions is not supported: these are base models with no chat template. Use POST /v1/completions (client.completions.create in the OpenAI SDK)."
    )]
    ChatCompletionsUnsupported,
    #[error(
        "prompt_logprobs=-1 (full vocabulary) allows prompts of at most {limit} tokens; this prompt has {tokens}. Use a fixed top-k instead."
    )]
    FullVocabPromptTooLong { tokens: u64, limit: u64 },
    #[error("{0}")]
    Unauthorized(&'static str),
    /// A key refused with a message that carries a time (it expired, or its previous
    /// secret's grace ended): 401 `invalid_api_key`, as any refused key.
    #[error("{0}")]
    KeyRefused(String),
    #[error("No route for {method} {path}.")]
    NotFound { method: String, path: String },
    #[error("No key with id or prefix '{0}'.")]
    KeyNotFound(String),
    /// A Workbench or Loom item, tree or node the calling key does not have: another
    /// key's is as absent as one that never existed (404, never 403).
    #[error("No {what} with id {id}.")]
    WorkbenchNotFound { what: &'static str, id: i64 },
    /// A change made from an older version of a Workbench or Loom record than the
    /// stored one (another tab changed it first); nothing was changed.
    #[error(
        "The {what} {id} is at version {current}, not {given}: it was changed elsewhere (in another tab?). Reload it and try again."
    )]
    VersionConflict {
        what: &'static str,
        id: i64,
        given: i64,
        current: i64,
    },
    /// No job of the caller's key has this id (another key's job included).
    #[error("No job with id '{0}'.")]
    JobNotFound(String),
    /// An `Idempotency-Key` already used by this key for a job with another body.
    #[error(
        "The Idempotency-Key '{0}' was already used with a different request body. Use a new key for a new request."
    )]
    IdempotencyKeyReused(String),
    /// The key already has as many queued and running jobs as allowed.
    #[error(
        "This key has {pending} jobs queued or running, the most allowed. Harvest some and retry."
    )]
    JobsPending { pending: u64, retry_after: Duration },
    /// The key's queued and running jobs hold so many request bytes that this one would
    /// take them over `jobs.max_pending_bytes_per_key`.
    #[error(
        "This key's queued and running jobs hold {pending_bytes} bytes of requests; this one's {request_bytes} bytes would take them over the limit of {limit} bytes. Harvest some and retry."
    )]
    JobsPendingBytes {
        pending_bytes: u64,
        request_bytes: usize,
        limit: u64,
        retry_after: Duration,
    },
    /// The key's request bodies being read at once would hold more than
    /// `connections.reading_bytes_per_key`; this one was not read.
    #[error(
        "This key's request bodies being uploaded now hold {held} bytes, and at most {limit} may be read at once. Retry when one of its uploads is done."
    )]
    BodiesBeingRead {
        held: usize,
        limit: usize,
        retry_after: Duration,
    },
    /// A Workbench or Loom write that would leave the key keeping more than
    /// `workbench.max_bytes_per_key`; nothing was written.
    #[error(
        "This change would leave this key keeping {bytes} bytes in the Workbench and Loom, over its limit of {limit} bytes; nothing was changed. Delete saved items or trees you no longer need, then try again."
    )]
    StorageQuotaExceeded { bytes: i64, limit: i64 },
    /// A Loom import with more nodes than `workbench.max_import_nodes`.
    #[error(
        "The import has {nodes} nodes, more than the limit of {limit}; nothing was imported. Split the tree, or import a branch of it."
    )]
    ImportTooLarge { nodes: usize, limit: u32 },
    /// `POST /admin/reload` found the config file invalid (or none to read); nothing
    /// was changed.
    #[error("{0}")]
    InvalidConfig(String),
    #[error("Method {method} is not allowed on {path}.")]
    MethodNotAllowed { method: String, path: String },
    #[error("The request body is larger than the limit of {limit} bytes.")]
    PayloadTooLarge { limit: usize },
    /// An HTTP/1 request head that could not be parsed (answered below the router, by
    /// `connections`). The message shows nothing of what was received.
    #[error(
        "The request line or a header line is malformed, so the request could not be read as HTTP/1.1. The connection is closed."
    )]
    MalformedHead,
    /// A request head over the connection's limits (answered below the router).
    #[error(
        "The request head (request line and headers) is over the limit of {max_bytes} bytes or {max_lines} header lines. The connection is closed."
    )]
    HeadTooLarge { max_bytes: usize, max_lines: usize },
    /// The body did not arrive within `connections.body_read_timeout_ms`.
    #[error("The request body did not arrive within {} ms of its headers.", .limit.as_millis())]
    RequestTimeout { limit: Duration },
    /// The upstream answered with an error status; its own message is passed on.
    #[error("{message}")]
    UpstreamRejected {
        status: StatusCode,
        kind: &'static str,
        message: String,
    },
    /// No upstream could be reached (refused, reset, DNS, no healthy node).
    #[error("{0}")]
    UpstreamUnavailable(String),
    #[error("This key started more than {rpm} requests per minute. Retry after {} s.", retry_after_secs(.retry_after))]
    RateLimited { rpm: u32, retry_after: Duration },
    #[error(
        "This key has {running} requests running and {queued} waiting, the most allowed. Retry shortly."
    )]
    QueueFull {
        running: u32,
        queued: u32,
        retry_after: Duration,
    },
    #[error(
        "This key's monthly budget of {budget} tokens has {} left for {month} ({used} used, {reserved} reserved by running requests), fewer than the {needed} this request needs at least. It resets at 00:00 UTC on the 1st.",
        budget_left(*.budget, *.used, *.reserved)
    )]
    BudgetExceeded {
        budget: u64,
        used: u64,
        reserved: u64,
        needed: u64,
        month: String,
        /// Until the budget resets.
        retry_after: Duration,
    },
    /// A non-streaming request asked for more tokens than can be generated within the
    /// request window.
    #[error(
        "max_tokens={max_tokens} cannot finish within the {window_secs} s window of a non-streaming request (about {fit} tokens fit at this model's decode rate). Send stream=true to generate up to the full max_tokens, or lower max_tokens."
    )]
    DeadlineInfeasible {
        max_tokens: u64,
        fit: u64,
        window_secs: u64,
    },
    /// The upstream did not answer a non-streaming request within the window; the
    /// generation was aborted.
    #[error(
        "The model server did not finish within the {window_secs} s window of a non-streaming request, so the generation was stopped. Send stream=true for long generations, or lower max_tokens."
    )]
    UpstreamDeadline { window_secs: u64 },
    /// The shared admission counters cannot be reached; requests are refused rather
    /// than run unmetered.
    #[error("Admission control is unavailable right now, so no request can start. Retry shortly.")]
    AdmissionUnavailable,
    /// The store is needed to answer (a key not in memory, or usage waiting to be
    /// recorded past the buffer's bound) and cannot be reached.
    #[error(
        "The key store cannot be reached right now, so this request cannot be checked or metered. Retry shortly."
    )]
    StoreUnavailable,
    /// Something on our side failed; the details go to the log, not to the client.
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

/// The `error` object of the envelope, carried from `into_response` to the envelope
/// middleware as a response extension.
#[derive(Debug, Clone)]
pub struct ErrorBody {
    pub code: &'static str,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<Cow<'static, str>>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: EnvelopeError<'a>,
    request_id: &'a str,
}

#[derive(Serialize)]
struct EnvelopeError<'a> {
    code: &'a str,
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'a str>,
}

impl ErrorBody {
    /// The envelope JSON: `{"error":{…},"request_id":…}`.
    pub fn envelope_json(&self, request_id: &str) -> Vec<u8> {
        let envelope = Envelope {
            error: EnvelopeError {
                code: self.code,
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
            },
            request_id,
        };
        serde_json::to_vec(&envelope).unwrap_or_default()
    }
}

/// What a budget has left beyond the used and reserved tokens.
fn budget_left(budget: u64, used: u64, reserved: u64) -> u64 {
    budget.saturating_sub(used.saturating_add(reserved))
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: None,
        }
    }

    pub fn invalid_param(param: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// 503 `store_unavailable` for a store that failed to serve `what`; the store's
    /// own error goes to the log, not to the client.
    pub fn store_unavailable(err: &crate::store::StoreError, what: &str) -> Self {
        tracing::warn!(error = %err, what, "the store failed");
        Self::StoreUnavailable
    }

    pub fn internal(err: impl Into<anyhow::Error>) -> Self {
        Self::Internal(err.into())
    }

    /// Whether a node's answer (or its silence) caused this error, rather than the
    /// gateway's own checks.
    pub fn from_upstream(&self) -> bool {
        self.upstream_error_kind().is_some()
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. }
            | Self::MalformedHead
            | Self::ModelNotFound(_)
            | Self::ChatCompletionsUnsupported
            | Self::FullVocabPromptTooLong { .. }
            | Self::DeadlineInfeasible { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) | Self::KeyRefused(_) => StatusCode::UNAUTHORIZED,
            Self::NotFound { .. }
            | Self::KeyNotFound(_)
            | Self::JobNotFound(_)
            | Self::WorkbenchNotFound { .. } => StatusCode::NOT_FOUND,
            Self::VersionConflict { .. } => StatusCode::CONFLICT,
            Self::IdempotencyKeyReused(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::InvalidConfig(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::PayloadTooLarge { .. }
            | Self::StorageQuotaExceeded { .. }
            | Self::ImportTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::HeadTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::UpstreamRejected { status, .. } => *status,
            Self::RateLimited { .. }
            | Self::QueueFull { .. }
            | Self::JobsPending { .. }
            | Self::JobsPendingBytes { .. }
            | Self::BodiesBeingRead { .. }
            | Self::BudgetExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::AdmissionUnavailable | Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::UpstreamUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::UpstreamDeadline { .. } => StatusCode::GATEWAY_TIMEOUT,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The machine-readable `error.code`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidRequest { .. } | Self::MalformedHead => "invalid_request",
            Self::ModelNotFound(_) => "model_not_found",
            Self::ChatCompletionsUnsupported => "chat_completions_unsupported",
            Self::FullVocabPromptTooLong { .. } => "full_vocab_prompt_too_long",
            Self::Unauthorized(_) | Self::KeyRefused(_) => "invalid_api_key",
            Self::NotFound { .. } => "not_found",
            Self::KeyNotFound(_) => "key_not_found",
            Self::WorkbenchNotFound { .. } => "not_found",
            Self::VersionConflict { .. } => "version_conflict",
            Self::JobNotFound(_) => "job_not_found",
            Self::IdempotencyKeyReused(_) => "idempotency_key_reused",
            Self::InvalidConfig(_) => "invalid_config",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
            Self::PayloadTooLarge { .. }
            | Self::HeadTooLarge { .. }
            | Self::ImportTooLarge { .. } => "request_too_large",
            Self::StorageQuotaExceeded { .. } => "storage_quota_exceeded",
            Self::RequestTimeout { .. } => "request_timeout",
            Self::UpstreamRejected { kind, .. } => kind,
            Self::UpstreamUnavailable(_) => "upstream_unavailable",
            Self::DeadlineInfeasible { .. } => "deadline_infeasible",
            Self::UpstreamDeadline { .. } => "upstream_deadline",
            Self::RateLimited { .. } => "rate_limited",
            Self::QueueFull { .. }
            | Self::JobsPending { .. }
            | Self::JobsPendingBytes { .. }
            | Self::BodiesBeingRead { .. } => "queue_full",
            Self::BudgetExceeded { .. } => "budget_exceeded",
            Self::AdmissionUnavailable => "admission_unavailable",
            Self::StoreUnavailable => "store_unavailable",
            Self::Internal(_) => "internal_error",
        }
    }

    /// The OpenAI-style `error.type`.
    fn kind(&self) -> &'static str {
        match self.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The `error` object of the envelope.
    pub fn body(&self) -> ErrorBody {
        let param = match self {
            Self::InvalidRequest { param, .. } => param.clone(),
            Self::ModelNotFound(_) => Some("model".into()),
            Self::FullVocabPromptTooLong { .. } => Some("prompt_logprobs".into()),
            Self::DeadlineInfeasible { .. } => Some("max_tokens".into()),
            Self::VersionConflict { .. } => Some("version".into()),
            _ => None,
        };
        ErrorBody {
            code: self.code(),
            message: self.to_string(),
            kind: self.kind(),
            param,
        }
    }
}

/// Whole seconds for `Retry-After`, rounded up, at least 1.
fn retry_after_secs(wait: &Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

impl ApiError {
    /// How long the client should wait before retrying (`Retry-After`), in the whole
    /// seconds it is told; `None` when a retry should not wait for a time (or cannot
    /// help: see [`ApiError::retry_futile`]).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::UpstreamRejected { status, .. } if status.is_server_error() => {
                Some(UPSTREAM_RETRY_AFTER)
            }
            Self::UpstreamUnavailable(_) | Self::AdmissionUnavailable | Self::StoreUnavailable => {
                Some(UPSTREAM_RETRY_AFTER)
            }
            Self::RateLimited { retry_after, .. }
            | Self::QueueFull { retry_after, .. }
            | Self::JobsPending { retry_after, .. }
            | Self::JobsPendingBytes { retry_after, .. }
            | Self::BodiesBeingRead { retry_after, .. }
            | Self::BudgetExceeded { retry_after, .. } => {
                Some(Duration::from_secs(retry_after_secs(retry_after)))
            }
            _ => None,
        }
    }

    /// Whether the same request cannot succeed on a retry (`X-Should-Retry: false`, which
    /// tells SDKs that retry not to): too large, a window it cannot fit, a budget spent
    /// until the month turns.
    pub fn retry_futile(&self) -> bool {
        matches!(
            self,
            Self::PayloadTooLarge { .. }
                | Self::HeadTooLarge { .. }
                | Self::StorageQuotaExceeded { .. }
                | Self::ImportTooLarge { .. }
                | Self::DeadlineInfeasible { .. }
                | Self::UpstreamDeadline { .. }
                | Self::BudgetExceeded { .. }
        )
    }

    /// `X-Acs-Upstream-Error-Kind`, which mirrors `error.code` on errors a node caused.
    pub fn upstream_error_kind(&self) -> Option<&'static str> {
        match self {
            Self::UpstreamRejected { kind, .. } => Some(kind),
            Self::UpstreamUnavailable(_) => Some("upstream_unavailable"),
            Self::UpstreamDeadline { .. } => Some("upstream_deadline"),
            _ => None,
        }
    }
}
