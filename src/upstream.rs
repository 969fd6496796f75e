//! HTTP to the vLLM servers: what a server serves and reports, tokenization, hooks and
//! forwarding completions. A leaf: it knows base URLs, not the fleet that holds them.
//!
//! Completions to `http://` nodes go through fleetgate's own HTTP/1.1 client (`wire::h1`,
//! which says why); everything else through reqwest.

use std::io;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt, TryStreamExt};
use http::{HeaderMap, HeaderValue, StatusCode};
use serde::Deserialize;

use crate::config::UpstreamSettings;
use crate::error::ApiError;
use crate::wire::h1;

/// A question to a node (`/health`, `/v1/models`, `/metrics`, `/tokenize`) is answered
/// within this, its body included, or fails as unreachable. The prober's shorter
/// `fleet.probe_timeout_ms` applies to its own questions too.
pub const QUESTION_TIME: Duration = Duration::from_secs(10);
/// Bodies of upstream error responses are read up to this size; the rest is dropped.
const ERROR_BODY_LIMIT: usize = 64 * 1024;
/// How long an error body is read for: a node that trickles one must not hold the
/// request (what arrived by then is used).
const ERROR_BODY_TIME: Duration = Duration::from_secs(5);
/// The largest `/v1/models` answer read: vLLM's is a few hundred bytes a model card,
/// LoRA adapters included. A node that sends more is not believed, not buffered.
const MODELS_BODY_LIMIT: usize = 1024 * 1024;
/// The largest `/metrics` answer read: vLLM's is ~100 KiB for a few engines.
const METRICS_BODY_LIMIT: usize = 8 * 1024 * 1024;
/// The largest `/tokenize` answer read, beyond what the prompt allows: the answer lists
/// the prompt's token ids (at most one a byte, each at most 7 characters with its comma).
const TOKENIZE_BODY_BASE: usize = 64 * 1024;
const TOKENIZE_BYTES_PER_PROMPT_BYTE: usize = 8;

/// What a vLLM server reported about itself in `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The served checkpoint name: what vLLM expects in `model` and reports back.
    pub name: String,
    pub max_model_len: u64,
}

/// One reading of a vLLM server's own load, from its `GET /metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct NodeLoad {
    /// `vllm:num_requests_running`, summed over engines: every replica's requests the
    /// node decodes now.
    pub running: u64,
    /// `vllm:num_requests_waiting`, summed over engines.
    pub waiting: u64,
    /// `vllm:kv_cache_usage_perc` (0.9.2+) or `vllm:gpu_cache_usage_perc` (older), the
    /// fullest engine, 0..1.
    pub kv_cache_usage: f64,
    /// `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (prompt
    /// tokens looked up in the prefix cache, and found), since the node started, summed
    /// over engines.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
}

#[derive(Clone)]
pub struct UpstreamClient {
    http: reqwest::Client,
    /// Completions to `http://` nodes.
    h1: h1::Client,
}

/// A response body as it arrives.
pub type ByteStream = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;

/// A node's answer to a forwarded completion: the head read, the body not yet.
pub enum NodeReply {
    H1(h1::Response),
    Reqwest(reqwest::Response),
}

impl NodeReply {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::H1(r) => r.status,
            Self::Reqwest(r) => r.status(),
        }
    }

    pub fn content_type(&self) -> Option<&HeaderValue> {
        match self {
            Self::H1(r) => r.content_type.as_ref(),
            Self::Reqwest(r) => r.headers().get(http::header::CONTENT_TYPE),
        }
    }

    /// The body's length, when the head gave one.
    pub fn content_length(&self) -> Option<u64> {
        match self {
            Self::H1(r) => r.content_length,
            Self::Reqwest(r) => r.content_length(),
        }
    }

    /// The body. Dropping it before its end closes the connection, which tells vLLM to
    /// stop generating.
    pub fn into_body(self) -> ByteStream {
        match self {
            Self::H1(r) => Box::pin(r.body),
            Self::Reqwest(r) => Box::pin(r.bytes_stream().map_err(io::Error::other)),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream {url} is unreachable: {source}")]
    Unreachable {
        url: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("upstream {url} answered {what}")]
    Unexpected { url: String, what: String },
}

impl UpstreamError {
    /// Whether the request provably never left: the connection to the node could not
    /// be made. (A connection that failed later may have delivered the request.)
    pub fn never_sent(&self) -> bool {
        let Self::Unreachable { source, .. } = self else {
            return false;
        };
        if let Some(err) = source.downcast_ref::<h1::Error>() {
            return matches!(err, h1::Error::Connect(_) | h1::Error::ConnectTimeout(_));
        }
        source
            .downcast_ref::<reqwest::Error>()
            .is_some_and(reqwest::Error::is_connect)
    }
}

impl From<UpstreamError> for ApiError {
    fn from(err: UpstreamError) -> Self {
        tracing::warn!(error = %err, "upstream failure");
        match err {
            UpstreamError::Unreachable { .. } => ApiError::UpstreamUnavailable(
                "The model server is unreachable right now. Retry shortly.".into(),
            ),
            UpstreamError::Unexpected { .. } => ApiError::UpstreamRejected {
                status: http::StatusCode::BAD_GATEWAY,
                kind: "upstream_error",
                message: "The model server gave an unexpected answer.".into(),
            },
        }
    }
}

impl NodeLoad {
    /// Reads the three gauges and the prefix-cache counters from Prometheus text; other lines, comments and
    /// unparseable values are skipped (label order and `_created` series vary by version).
    pub fn parse(text: &str) -> Self {
        let mut load = Self::default();
        for line in text.lines() {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            if !value.is_finite() || value < 0.0 {
                continue;
            }
            let name = series.split('{').next().unwrap_or("").trim();
            match name {
                "vllm:num_requests_running" => load.running += value as u64,
                "vllm:num_requests_waiting" => load.waiting += value as u64,
                "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                    load.kv_cache_usage = load.kv_cache_usage.max(value);
                }
                "vllm:prefix_cache_queries_total" => load.prefix_cache_queries += value as u64,
                "vllm:prefix_cache_hits_total" => load.prefix_cache_hits += value as u64,
                _ => {}
            }
        }
        load
    }
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelCard>,
}

#[derive(Deserialize)]
struct ModelCard {
    id: String,
    max_model_len: Option<u64>,
    #[serde(default)]
    parent: Option<String>,
}

#[derive(Deserialize)]
struct TokenizeResponse {
    count: u64,
}

impl UpstreamClient {
    pub fn new(settings: &UpstreamSettings) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(settings.connect_timeout_ms))
            .pool_idle_timeout(Duration::from_millis(settings.pool_idle_timeout_ms))
            .tcp_nodelay(true)
            .build()?;
        let h1 = h1::Client::new(
            Duration::from_millis(settings.connect_timeout_ms),
            Duration::from_millis(settings.pool_idle_timeout_ms),
        );
        Ok(Self { http, h1 })
    }

    /// `GET {path}` on the upstream; any status but a 2xx is an error.
    async fn get_ok(&self, url: &str, path: &str) -> Result<reqwest::Response, UpstreamError> {
        let response = self
            .http
            .get(format!("{}{path}", url))
            .timeout(QUESTION_TIME)
            .send()
            .await
            .map_err(unreachable(url))?;
        if response.status().is_success() {
            Ok(response)
        } else {
            Err(UpstreamError::Unexpected {
                url: url.to_owned(),
                what: format!("{} on GET {path}", response.status()),
            })
        }
    }

    /// `GET /health`: a 2xx means the engine is alive.
    pub async fn health(&self, url: &str) -> Result<(), UpstreamError> {
        self.get_ok(url, "/health").await.map(drop)
    }

    /// `GET /metrics`: the node's own queue and KV-cache use.
    pub async fn node_load(&self, url: &str) -> Result<NodeLoad, UpstreamError> {
        let response = self.get_ok(url, "/metrics").await?;
        let body = read_bounded(response, url, "/metrics", METRICS_BODY_LIMIT).await?;
        Ok(NodeLoad::parse(&String::from_utf8_lossy(&body)))
    }

    /// `POST` to a model's wake or sleep hook; `Ok` on a 2xx answer. Errors name the
    /// hook by scheme, host and port only: its path, query or user info may carry a
    /// token.
    pub async fn call_hook(&self, url: &str, timeout: Duration) -> Result<(), UpstreamError> {
        let shown = reqwest::Url::parse(url)
            .map(|u| u.origin().ascii_serialization())
            .unwrap_or_else(|_| "the hook".to_owned());
        let response = self
            .http
            .post(url)
            .timeout(timeout)
            .send()
            .await
            .map_err(|source| UpstreamError::Unreachable {
                url: shown.clone(),
                source: source.without_url().into(),
            })?;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(UpstreamError::Unexpected {
                url: shown,
                what: format!("{} to the hook", response.status()),
            })
        }
    }

    /// Asks the upstream what it serves (`GET /v1/models`).
    pub async fn read_served(&self, url: &str) -> Result<Served, UpstreamError> {
        let response = self.get_ok(url, "/v1/models").await?;
        let unexpected = |what: String| UpstreamError::Unexpected {
            url: url.to_owned(),
            what,
        };
        let body = read_bounded(response, url, "/v1/models", MODELS_BODY_LIMIT).await?;
        let list: ModelList = serde_json::from_slice(&body)
            .map_err(|e| unexpected(format!("an unreadable /v1/models: {e}")))?;
        // The base model's card; LoRA adapters carry a parent and no context length.
        let card = list
            .data
            .into_iter()
            .find(|c| c.parent.is_none())
            .ok_or_else(|| unexpected("no base model in /v1/models".into()))?;
        let max_model_len = card
            .max_model_len
            .ok_or_else(|| unexpected("no max_model_len in /v1/models".into()))?;
        Ok(Served {
            name: card.id,
            max_model_len,
        })
    }

    /// Counts the tokens of a text prompt with the upstream's own tokenizer.
    pub async fn count_tokens(
        &self,
        url: &str,
        served: &Served,
        prompt: &str,
        add_special_tokens: bool,
    ) -> Result<u64, ApiError> {
        let body = serde_json::json!({
            "model": served.name,
            "prompt": prompt,
            "add_special_tokens": add_special_tokens,
        });
        let response = self
            .http
            .post(format!("{}/tokenize", url))
            .timeout(QUESTION_TIME)
            .json(&body)
            .send()
            .await
            .map_err(unreachable(url))?;
        if !response.status().is_success() {
            return Err(upstream_rejection(response).await);
        }
        let limit = TOKENIZE_BODY_BASE
            .saturating_add(prompt.len().saturating_mul(TOKENIZE_BYTES_PER_PROMPT_BYTE));
        let body = read_bounded(response, url, "/tokenize", limit).await?;
        let parsed: TokenizeResponse =
            serde_json::from_slice(&body).map_err(|e| UpstreamError::Unexpected {
                url: url.to_owned(),
                what: format!("an unreadable /tokenize answer: {e}"),
            })?;
        Ok(parsed.count)
    }

    /// Sends a completion request with `headers` besides its own (the trace context);
    /// the answer (any status) is returned with its body unread.
    pub async fn send_completion(
        &self,
        url: &str,
        body: Bytes,
        headers: &HeaderMap,
    ) -> Result<NodeReply, UpstreamError> {
        const PATH: &str = "/v1/completions";
        if let Some(target) = h1::Target::parse(url) {
            return self
                .h1
                .post_json(target, PATH, headers, &body)
                .await
                .map(NodeReply::H1)
                .map_err(|source| UpstreamError::Unreachable {
                    url: url.to_owned(),
                    source: source.into(),
                });
        }
        self.http
            .post(format!("{url}{PATH}"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .headers(headers.clone())
            .body(body)
            .send()
            .await
            .map(NodeReply::Reqwest)
            .map_err(unreachable(url))
    }
}

/// The error for a request to `url` that got no answer.
fn unreachable(url: &str) -> impl Fn(reqwest::Error) -> UpstreamError + '_ {
    |source| UpstreamError::Unreachable {
        url: url.to_owned(),
        source: source.into(),
    }
}

/// Turns an upstream error response into our envelope, keeping vLLM's own message
/// (it tells the client what to fix, e.g. the context length).
pub async fn upstream_rejection(response: impl Into<NodeReply>) -> ApiError {
    let response = response.into();
    let status = response.status();
    let body = read_up_to(response.into_body(), ERROR_BODY_LIMIT, ERROR_BODY_TIME).await;
    let message =
        vllm_error_message(&body).unwrap_or_else(|| format!("The model server answered {status}."));
    if status == StatusCode::BAD_REQUEST {
        ApiError::UpstreamRejected {
            status,
            kind: "upstream_bad_request",
            message,
        }
    } else {
        // Anything else (5xx, or a 4xx other than 400, which means our configuration and
        // the server disagree) is not the client's to fix.
        tracing::warn!(upstream_status = status.as_u16(), "upstream error status");
        ApiError::UpstreamRejected {
            status: StatusCode::BAD_GATEWAY,
            kind: "upstream_error",
            message,
        }
    }
}

impl From<reqwest::Response> for NodeReply {
    fn from(response: reqwest::Response) -> Self {
        Self::Reqwest(response)
    }
}

/// The first `limit` bytes of a body, or as much of them as arrived before an error or
/// before `time` was up.
async fn read_up_to(mut body: ByteStream, limit: usize, time: Duration) -> Vec<u8> {
    let mut read = Vec::new();
    let reading = async {
        while let Some(Ok(chunk)) = body.next().await {
            let room = limit.saturating_sub(read.len());
            read.extend_from_slice(&chunk[..chunk.len().min(room)]);
            if room <= chunk.len() {
                break;
            }
        }
    };
    // Out of time, what arrived is the body.
    let _ = tokio::time::timeout(time, reading).await;
    read
}

/// A whole answer of at most `limit` bytes; a longer one (or a longer announced one) is
/// an error as soon as it is seen, with nothing more read. Its time is the caller's to
/// bound (every caller does).
async fn read_bounded(
    mut response: reqwest::Response,
    url: &str,
    path: &str,
    limit: usize,
) -> Result<Vec<u8>, UpstreamError> {
    let too_long = || UpstreamError::Unexpected {
        url: url.to_owned(),
        what: format!("an answer to {path} longer than {limit} bytes"),
    };
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_long());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(unreachable(url))? {
        if body.len() + chunk.len() > limit {
            return Err(too_long());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// vLLM's message from either envelope form (0.10.1+ nested, older flat), or a
/// FastAPI `detail`.
fn vllm_error_message(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let message = value
        .pointer("/error/message")
        .or_else(|| value.get("message"))
        .or_else(|| value.get("detail"))?;
    match message {
        serde_json::Value::String(s) if !s.is_empty() => Some(s.clone()),
        serde_json::Value::String(_) => None,
        other => Some(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_running_waiting_and_kv_cache_across_engines_and_versions() {
        let text = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m",engine="1"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
http_requests_total{handler="/v1/completions"} 12.0
garbage line
vllm:num_requests_waiting{engine="2"} NaN
"#;
        assert_eq!(
            NodeLoad::parse(text),
            NodeLoad {
                running: 9,
                waiting: 5,
                kv_cache_usage: 0.5,
                prefix_cache_queries: 1500,
                prefix_cache_hits: 600,
            }
        );
        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.75\n";
        assert_eq!(NodeLoad::parse(old).kv_cache_usage, 0.75);
        assert_eq!(NodeLoad::parse(""), NodeLoad::default());
    }
}
