//! A simulated vLLM OpenAI-compatible server (see `shared/vllm-protocol.md`), for the
//! gateway's tests and its `demo` command. It mimics vLLM 0.10.2–0.12 wire shapes:
//! `POST /v1/completions` (stream and non-stream), `GET /v1/models`, `POST /tokenize`,
//! `GET /health`, `GET /metrics`, FastAPI-style 404/405.
//!
//! Behaviour worth knowing when writing tests against it:
//! - Tokenizer ([`tokenizer`]): deterministic and static; text round-trips exactly through
//!   encode/decode when `vocab_size` ≥ 323 (every byte has an id). BOS is
//!   `<|begin_of_text|>`, id 128 000 when `vocab_size` > 128 000, else id 1.
//! - Generation draws whole words from a small list, `" the"` being the likeliest, so
//!   `"stop": " the"` fires reliably within a few dozen tokens. It never emits EOS: without a
//!   stop, every choice ends with `finish_reason: "length"`. Same request ⇒ same output.
//! - `"max_tokens": null` reproduces vLLM's bug (§6.5): non-stream ⇒ 500 with the
//!   `Internal Server Error` envelope; stream ⇒ an SSE error event with an empty message.
//! - Engine-side checks (logprob limits, out-of-vocab ids, empty decoder prompt) answer
//!   4xx JSON before the stream starts, as 0.12 does (≤0.11 sent an SSE error event).
//! - `prompt_logprobs: -1` is accepted whatever `max_logprobs` is; its body is streamed.

mod body;
mod completions;
mod endpoints;
mod error;
mod generate;
mod lax;
mod listener;
mod logprobs;
mod model;
mod request;
mod server;
mod sse;
mod state;
pub mod tokenizer;

use std::time::Duration;

pub use server::MockVllm;

/// How the mock presents itself; mirrors the vLLM flags of the same names.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// `--served-model-name`; the only model id the mock answers to.
    pub served_model_name: String,
    /// `--max-model-len`: context length used by the length check.
    pub max_model_len: u32,
    /// `--max-logprobs`: the cap on `logprobs` and `prompt_logprobs` (except −1).
    pub max_logprobs: u32,
    /// Vocabulary size; full-vocab `prompt_logprobs` (−1) emits this many entries per position.
    pub vocab_size: u32,
    /// Delay before the first stream chunk, and before a non-stream body.
    pub time_to_first_token: Duration,
    /// Delay between generated tokens (stream chunks); a non-stream body also waits for them.
    pub token_delay: Duration,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            served_model_name: "meta-llama/Llama-3.1-8B".to_owned(),
            max_model_len: 8192,
            max_logprobs: 20,
            vocab_size: 128_256,
            time_to_first_token: Duration::ZERO,
            token_delay: Duration::ZERO,
        }
    }
}

/// A fault to inject; set with [`MockVllm::set_failure`].
#[derive(Clone, Debug, PartialEq)]
pub enum FailureMode {
    None,
    /// Stop accepting connections (and close open ones): connect attempts get "connection
    /// refused" until another mode is set, which reopens the listener on the same port.
    Refuse,
    /// Every /v1/completions answers 500 with vLLM's error envelope; /health answers 503.
    Status500,
    /// A wedged server: accept requests on /v1/completions, /tokenize, /health and
    /// /v1/models and never answer them (until the client goes away).
    Hang,
    /// Streams: send `after_chunks` SSE data frames, then drop the connection without
    /// `[DONE]`. Non-stream: send part of the body, then drop the connection.
    CutStream {
        after_chunks: usize,
    },
    /// Streams: send `after_chunks` content frames, then vLLM's mid-stream error event
    /// (HTTP status still 200) and `[DONE]`, as vLLM does when the engine fails mid-way.
    StreamError {
        after_chunks: usize,
    },
}

/// A request as the mock received it (on /v1/completions and /tokenize).
#[derive(Clone, Debug)]
pub struct ReceivedRequest {
    pub method: String,
    pub path: String,
    pub headers: http::HeaderMap,
    pub body: bytes::Bytes,
}

impl ReceivedRequest {
    /// The body parsed as JSON, or `Value::Null` when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}
