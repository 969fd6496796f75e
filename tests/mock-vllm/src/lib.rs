//! A simulated vLLM OpenAI-compatible server, for the
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
//! - `"max_tokens": null` reproduces vLLM's bug: non-stream ⇒ 500 with the
//!   `Internal Server Error` envelope; stream ⇒ an SSE error event with an empty message.
//! - Engine-side checks (logprob limits, out-of-vocab ids, empty decoder prompt) answer
//!   4xx JSON before the stream starts, as 0.12 does (≤0.11 sent an SSE error event).
//! - `prompt_logprobs: -1` is accepted whatever `max_logprobs` is; its body is streamed.
//! - Prefix cache ([`MockConfig::prefix_cache_tokens`]): an LRU of 16-token blocks per
//!   node; the uncached prompt tokens cost [`MockConfig::prefill_per_token`] each before
//!   the first token (one prefill at a time; those waiting for it are
//!   `vllm:num_requests_waiting`), and `/metrics` counts queries and hits.
//! - Batch ([`MockConfig::max_num_seqs`], `--max-num-seqs`): at most that many requests
//!   are decoded at once, each from its place in the batch until its response ends; the
//!   others wait for one in arrival order. `/metrics` reports the batch as
//!   `vllm:num_requests_running`, those waiting for a place (and for a prefill) as
//!   `vllm:num_requests_waiting`, and `vllm:kv_cache_usage_perc` as running / N. Without
//!   it, every request in flight runs and counts as running (1% of KV cache each).

mod body;
mod completions;
mod config;
mod endpoints;
mod error;
mod generate;
mod lax;
mod listener;
mod lock;
mod logprobs;
mod model;
mod prefix_cache;
mod request;
mod server;
mod sse;
mod state;
pub mod tokenizer;

pub use config::{FailureMode, MockConfig, ReceivedRequest};
pub use server::MockVllm;
