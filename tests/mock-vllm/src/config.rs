//! What a test sets: how the mock presents itself, the fault to inject; and what it
//! records of each request.

use std::time::Duration;

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
    /// Tokens the prefix cache holds (whole 16-token blocks, least recently used evicted
    /// first); 0 caches nothing. Queries and hits are counted either way.
    pub prefix_cache_tokens: usize,
    /// Prefill time per prompt token not found in the prefix cache, added before the
    /// first token; prefills run one at a time per node, like a GPU's. Zero: none.
    pub prefill_per_token: Duration,
    /// `--max-num-seqs`: requests decoded at once (the batch). More wait their turn,
    /// first come first served as vLLM's scheduler takes them, and are reported as
    /// `vllm:num_requests_waiting`; the KV-cache usage is the share of the batch in use.
    /// `None`: no limit, every request runs at once (and the KV-cache usage is a made-up
    /// 1% per running request).
    pub max_num_seqs: Option<u32>,
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
            prefix_cache_tokens: 0,
            prefill_per_token: Duration::ZERO,
            max_num_seqs: None,
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
    /// A buggy or hostile server's small answers: /v1/models, /tokenize and /metrics
    /// answer 200 with a body that never ends, as fast as it is read. Completions and
    /// /health are as usual.
    Endless,
    /// Streams go on past `max_tokens`, a one-token frame at a time (paced by
    /// `token_delay`), until the client goes away. Non-stream answers are as usual.
    Overgenerate,
    /// Every completion reports usage of `i64::MAX` completion tokens, stream or not.
    AbsurdUsage,
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
