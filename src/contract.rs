//! The names and numbers the public API fixes, each in one place: the headers fleetgate
//! reads and writes, and the bounds of a completion request. The parser, the planner,
//! the configuration and the error rendering take them from here; the OpenAPI document
//! repeats the bounds as literals, and a test walks them against the parser.

use http::HeaderName;

/// `X-Request-Id`: on every response, the same id as the error envelope's `request_id`.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// `X-Should-Retry`: tells openai-python not to retry what a retry cannot fix.
pub const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
/// `X-Acs-Upstream-Error-Kind`: mirrors `error.code` on upstream-caused errors.
pub const X_ACS_UPSTREAM_ERROR_KIND: HeaderName =
    HeaderName::from_static("x-acs-upstream-error-kind");
/// `X-Acs-Upstream-Model`: the checkpoint that served (or failed) the request.
pub const X_ACS_UPSTREAM_MODEL: HeaderName = HeaderName::from_static("x-acs-upstream-model");
/// `X-Acs-Upstream-Gpu`: the GPU node that served (or failed) the request.
pub const X_ACS_UPSTREAM_GPU: HeaderName = HeaderName::from_static("x-acs-upstream-gpu");
/// `X-Acs-Max-Tokens-Clamped`: `max_tokens` was cut (by the request window or budget).
pub const X_ACS_MAX_TOKENS_CLAMPED: HeaderName =
    HeaderName::from_static("x-acs-max-tokens-clamped");
/// `X-Acs-Budget-Clamp`: `refuse` asks for `budget_exceeded` where the budget would
/// clamp `max_tokens` (the Workbench and Loom send it); `clamp`, the default, clamps.
pub const X_ACS_BUDGET_CLAMP: HeaderName = HeaderName::from_static("x-acs-budget-clamp");
/// `X-Acs-Workload`: `interactive` or `batch`, as the client declares it.
pub const X_ACS_WORKLOAD: HeaderName = HeaderName::from_static("x-acs-workload");
/// `declined` on a harvest long-poll answered early because too many were waiting.
pub const X_ACS_LONGPOLL: HeaderName = HeaderName::from_static("x-acs-longpoll");
/// RFC 7240: `Prefer: respond-async` asks for a completion job.
pub const PREFER: HeaderName = HeaderName::from_static("prefer");
pub const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");
/// The IETF idempotency-key draft's request header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The longest long-poll `GET /v1/harvest/{id}?wait=` may ask for, in seconds.
pub const MAX_HARVEST_WAIT_SECS: u64 = 60;

/// The largest `max_tokens` a client may send.
pub const MAX_TOKENS_LIMIT: u64 = 1_000_000;
/// The cap on worst-case output work: `prompt_count × n × max_tokens`.
pub const MAX_OUTPUT_WORK: u64 = 32_000;
/// The largest `logprobs` allowed at all; a model's cap (`max_logprobs`) may be lower.
pub const LOGPROBS_LIMIT: u32 = 100;
/// Longest prompt (in tokens) allowed with `prompt_logprobs: -1`.
pub const FULL_VOCAB_MAX_PROMPT_TOKENS: u64 = 1024;

/// What a request is for, as `X-Acs-Workload` declares it (capacity planning and
/// keep-warm); jobs run as `batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    Interactive,
    Batch,
}

impl Workload {
    /// One of the two known values; anything else is ignored (`None`).
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "interactive" => Some(Self::Interactive),
            "batch" => Some(Self::Batch),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Interactive => "interactive",
            Self::Batch => "batch",
        }
    }
}
