//! The OpenAPI document's frame (info, tags, security schemes) and the documentation
//! schemas the route annotations refer to; `router::openapi_document` puts the routes'
//! annotations over it. The request parser in
//! `completion::request` is the authority on the rules; a test walks this document's
//! bounds against the parser so the two cannot drift apart.

#![expect(
    dead_code,
    reason = "documentation-only types: read by utoipa, never constructed"
)]

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "fleetgate",
        description = "OpenAI-compatible `POST /v1/completions` for raw next-token generation against base models served by vLLM. Requests are validated strictly (unknown fields, out-of-range values and wrong types are 400); responses pass through verbatim from vLLM. Every error is `{\"error\":{\"code\",\"message\",\"type\"},\"request_id\"}`; every response carries `X-Request-Id`. On any route, an HTTP/1 request head that cannot be parsed gets 400 `invalid_request` and one over 16 KiB or 100 header lines 431 `request_too_large`, in the same envelope, and the connection is closed."
    ),
    modifiers(&BearerAuth),
    tags(
        (name = "completions", description = "Text completions against base models."),
        (name = "models", description = "The models this deployment serves."),
        (name = "usage", description = "The calling key's budget and limits."),
        (name = "workbench", description = "What the Workbench (`GET /workbench`) and Loom (`GET /loom`) pages keep per key: saved prompts and runs, recovery checkpoints of unsaved runs (expire after seven days), Loom trees and their nodes. Another key's records are never shown (404). Changes name the version they were made from; a stale one is 409 `version_conflict`."),
        (name = "jobs", description = "Completion jobs: submit with `POST /v1/completions` and `Prefer: respond-async` (answered 202 with `Location: /v1/harvest/{id}`), collect with `GET /v1/harvest/{id}?wait=S`. Jobs are kept in the store and survive restarts. Retention: a job still queued 24 hours after submission expires; its request and result are deleted 24 hours after it ends; the rest of it (status, times, the Idempotency-Key) 7 days after it ends."),
        (name = "ops", description = "Health."),
        (name = "admin", description = "Key management and live fleet changes (`POST /admin/reload`), with the admin token (`admin_token` in the config). Not part of the client API."),
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "admin",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("The admin token from the configuration."))
                    .build(),
            ),
        );
    }
}

/// Request body of `POST /v1/completions`. Fields not listed here are rejected
/// (`Unknown field '…'`); numbers never accept booleans or strings; integer fields
/// accept only integers; `null` means "not given".
#[derive(ToSchema)]
#[schema(as = CompletionRequest)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequestDoc {
    /// Short model id from `GET /v1/models` (e.g. `llama-8b`). Omitted: the default model. Unknown: 400 `model_not_found`.
    model: Option<String>,
    prompt: PromptDoc,
    /// Tokens to generate per completion. Required for batches and `n > 1`; for a single prompt with `n = 1` it defaults to `min(32000, max_model_len - prompt_tokens)`. `prompt_count × n × max_tokens` must not exceed 32000. 0 is not supported.
    #[schema(minimum = 1, maximum = 1000000)]
    max_tokens: Option<u32>,
    /// Completions per prompt.
    #[schema(minimum = 1, maximum = 16, default = 1)]
    n: Option<u32>,
    stop: Option<StopDoc>,
    /// Sampling temperature; 0 is greedy.
    #[schema(minimum = 0, maximum = 100, default = 1.0)]
    temperature: Option<f64>,
    /// Nucleus sampling threshold, strictly positive.
    #[schema(exclusive_minimum = 0, maximum = 1, default = 1.0)]
    top_p: Option<f64>,
    /// Keep only the top-k tokens; -1 disables. 0 is rejected.
    #[schema(minimum = -1, default = -1)]
    top_k: Option<i64>,
    /// Minimum probability relative to the top token.
    #[schema(minimum = 0, maximum = 1, default = 0.0)]
    min_p: Option<f64>,
    #[schema(minimum = -2, maximum = 2, default = 0.0)]
    presence_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2, default = 0.0)]
    frequency_penalty: Option<f64>,
    /// Multiplicative repetition penalty, strictly positive.
    #[schema(exclusive_minimum = 0, maximum = 2, default = 1.0)]
    repetition_penalty: Option<f64>,
    /// PRNG seed (a signed 64-bit integer, non-negative).
    #[schema(minimum = 0, maximum = 9223372036854775807_i64)]
    seed: Option<i64>,
    /// Top-k logprobs per generated token (0 = the sampled token only). At most the model's `capabilities.max_logprobs`.
    #[schema(minimum = 0, maximum = 100)]
    logprobs: Option<u32>,
    /// Top-k logprobs per prompt position; -1 = the full vocabulary (prompt at most `capabilities.full_vocab_max_prompt_tokens` tokens, else 400 `full_vocab_prompt_too_long`). Values other than 0 are rejected with `stream: true`.
    #[schema(minimum = -1, maximum = 100)]
    prompt_logprobs: Option<i32>,
    /// Prepend the prompt to each choice's text.
    #[schema(default = false)]
    echo: Option<bool>,
    /// Stream the answer as server-sent events.
    #[schema(default = false)]
    stream: Option<bool>,
    stream_options: Option<StreamOptionsDoc>,
    /// Free-form tag echoed back for your own bookkeeping.
    user: Option<String>,
    /// Whether the tokenizer prepends the model's BOS token to text prompts.
    #[schema(default = true)]
    add_special_tokens: Option<bool>,
}

/// A string, a batch of strings, a list of token ids, or a batch of token-id lists. Empty lists and a batch holding an empty token list are rejected; `""` is accepted (BOS only).
#[derive(ToSchema)]
#[schema(as = Prompt)]
#[serde(untagged)]
pub enum PromptDoc {
    Text(String),
    TextBatch(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatch(Vec<Vec<u32>>),
}

/// A stop string, or up to 4 of them. Empty strings are rejected.
#[derive(ToSchema)]
#[schema(as = Stop)]
#[serde(untagged)]
pub enum StopDoc {
    One(String),
    Many(Vec<String>),
}

/// Only with `stream: true`; unknown keys are rejected.
#[derive(ToSchema)]
#[schema(as = StreamOptions)]
#[serde(deny_unknown_fields)]
pub struct StreamOptionsDoc {
    /// Send a final chunk with `choices: []` and the usage totals before `[DONE]`.
    include_usage: Option<bool>,
    /// Attach running usage to every content chunk.
    continuous_usage_stats: Option<bool>,
}

/// One server-sent event of a streamed completion (`stream: true`; `schema` of
/// `text/event-stream` describes each event, as OpenAPI 3.2's `itemSchema` does). The
/// comment lines sent while a model boots (`: booting`) are no events.
#[derive(ToSchema)]
#[schema(as = CompletionStreamEvent)]
pub struct CompletionStreamEventDoc {
    /// A `text_completion` chunk as JSON, passed through verbatim from vLLM (with `stream_options.include_usage`, the last one before `[DONE]` has `choices: []` and the usage); the error envelope as JSON when the request fails after its 200 was sent; `[DONE]` last.
    data: String,
}

/// A vLLM `text_completion` object, passed through verbatim.
#[derive(ToSchema)]
#[schema(as = CompletionResponse)]
pub struct CompletionResponseDoc {
    id: String,
    /// Always `text_completion`.
    object: String,
    created: i64,
    /// The checkpoint that served the request.
    model: String,
    #[schema(value_type = Vec<Object>)]
    choices: Vec<serde_json::Value>,
    #[schema(value_type = Object)]
    usage: serde_json::Value,
}

/// A completion job, as submitted (`POST /v1/completions` with `Prefer: respond-async`)
/// and harvested (`GET /v1/harvest/{id}`).
#[derive(ToSchema)]
#[schema(as = Job)]
pub struct JobDoc {
    /// `job_…`.
    id: String,
    /// Always `completion.job`.
    object: String,
    /// `queued → running → succeeded | failed`; `queued → expired | cancelled`;
    /// `running → cancelled`.
    #[schema(value_type = String, example = "queued")]
    status: crate::store::JobStatus,
    /// The model id the request named (or the default).
    model: String,
    /// Unix seconds of the submission.
    created_at: i64,
    /// Unix seconds of the first run's start.
    started_at: Option<i64>,
    /// Unix seconds of the end.
    finished_at: Option<i64>,
    /// While queued: when the job expires unless it has started (24 h after
    /// submission). Once ended: when its request and result are deleted (24 h after the
    /// end). Absent while running.
    expires_at: Option<i64>,
    /// Runs started: more than 1 when a run never reached a node and was retried, or
    /// its server stopped and another took the job over.
    attempts: i64,
    /// Present (true) while a running job is being cancelled.
    cancel_requested: Option<bool>,
    /// When `succeeded`: the exact `POST /v1/completions` response body vLLM produced,
    /// with its `usage`. Deleted 24 h after the end.
    #[schema(value_type = Option<Object>)]
    result: Option<serde_json::Value>,
    /// When `failed`: the error envelope a synchronous call would have got (deleted 24 h
    /// after the end). When `cancelled` or `expired`: an envelope with code
    /// `job_cancelled` or `job_expired`.
    error: Option<ErrorEnvelopeDoc>,
}

/// A page of the calling key's jobs, newest first.
#[derive(ToSchema)]
#[schema(as = JobPage)]
pub struct JobPageDoc {
    /// Always `list`.
    object: String,
    /// The jobs without their content: a succeeded job's `result` is left out (harvest
    /// the job for it); a failed one's `error` envelope is kept.
    data: Vec<JobDoc>,
    first_id: Option<String>,
    /// Pass as `after` for the next page.
    last_id: Option<String>,
    has_more: bool,
}

/// Every error response.
#[derive(ToSchema)]
#[schema(as = ErrorEnvelope)]
pub struct ErrorEnvelopeDoc {
    error: ErrorDoc,
    /// Same as the `X-Request-Id` header.
    request_id: String,
}

#[derive(ToSchema)]
#[schema(as = Error)]
pub struct ErrorDoc {
    /// Machine-readable code: `invalid_request`, `model_not_found`, `chat_completions_unsupported`, `full_vocab_prompt_too_long`, `invalid_api_key`, `not_found`, `method_not_allowed`, `request_timeout`, `request_too_large`, `rate_limited`, `queue_full`, `budget_exceeded`, `admission_unavailable`, `store_unavailable`, `job_not_found`, `idempotency_key_reused`, `job_cancelled` and `job_expired` (in a job's `error`), `key_not_found` and `invalid_config` (admin), `upstream_bad_request`, `upstream_error`, `upstream_unavailable`, `internal_error`.
    code: String,
    message: String,
    /// `invalid_request_error`, `authentication_error`, `rate_limit_error` or `server_error`.
    #[serde(rename = "type")]
    kind: String,
    /// The request field at fault, when one is.
    param: Option<String>,
}
