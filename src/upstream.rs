//! HTTP to the vLLM servers: model discovery, tokenization and forwarding completions.

use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;

use crate::config::UpstreamSettings;
use crate::error::ApiError;
use crate::fleet::{Served, Upstream};

/// Bodies of upstream error responses are read up to this size; the rest is dropped.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

#[derive(Clone)]
pub struct UpstreamClient {
    http: reqwest::Client,
}

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream {url} is unreachable: {source}")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("upstream {url} answered {what}")]
    Unexpected { url: String, what: String },
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
        Ok(Self { http })
    }

    /// What the upstream serves: remembered, or asked.
    pub async fn discover(
        &self,
        upstream: &Upstream,
    ) -> Result<std::sync::Arc<Served>, UpstreamError> {
        match upstream.served() {
            Some(served) => Ok(served),
            None => self.fetch_served(upstream).await,
        }
    }

    /// `GET {path}` on the upstream; any status but a 2xx is an error.
    async fn get_ok(
        &self,
        upstream: &Upstream,
        path: &str,
    ) -> Result<reqwest::Response, UpstreamError> {
        let response = self
            .http
            .get(format!("{}{path}", upstream.url))
            .send()
            .await
            .map_err(unreachable(upstream))?;
        if response.status().is_success() {
            Ok(response)
        } else {
            Err(UpstreamError::Unexpected {
                url: upstream.url.clone(),
                what: format!("{} on GET {path}", response.status()),
            })
        }
    }

    /// `GET /health`: a 2xx means the engine is alive.
    pub async fn health(&self, upstream: &Upstream) -> Result<(), UpstreamError> {
        self.get_ok(upstream, "/health").await.map(drop)
    }

    /// `GET /metrics`: the node's own queue and KV-cache use.
    pub async fn node_load(
        &self,
        upstream: &Upstream,
    ) -> Result<crate::fleet::load::NodeLoad, UpstreamError> {
        let text = self
            .get_ok(upstream, "/metrics")
            .await?
            .text()
            .await
            .map_err(unreachable(upstream))?;
        Ok(crate::fleet::load::NodeLoad::parse(&text))
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
                source: source.without_url(),
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

    /// Asks the upstream what it serves (`GET /v1/models`) and remembers the answer.
    pub async fn fetch_served(
        &self,
        upstream: &Upstream,
    ) -> Result<std::sync::Arc<Served>, UpstreamError> {
        let served = self.read_served(upstream).await?;
        Ok(upstream.set_served(served))
    }

    /// Asks the upstream what it serves (`GET /v1/models`).
    pub async fn read_served(&self, upstream: &Upstream) -> Result<Served, UpstreamError> {
        let response = self.get_ok(upstream, "/v1/models").await?;
        let unexpected = |what: String| UpstreamError::Unexpected {
            url: upstream.url.clone(),
            what,
        };
        let list: ModelList = response
            .json()
            .await
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
        upstream: &Upstream,
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
            .post(format!("{}/tokenize", upstream.url))
            .json(&body)
            .send()
            .await
            .map_err(unreachable(upstream))?;
        if !response.status().is_success() {
            return Err(upstream_rejection(response).await);
        }
        let parsed: TokenizeResponse =
            response
                .json()
                .await
                .map_err(|e| UpstreamError::Unexpected {
                    url: upstream.url.clone(),
                    what: format!("an unreadable /tokenize answer: {e}"),
                })?;
        Ok(parsed.count)
    }

    /// Sends a completion request; the response (any status) is returned unread.
    pub async fn send_completion(
        &self,
        upstream: &Upstream,
        body: Bytes,
    ) -> Result<reqwest::Response, UpstreamError> {
        self.http
            .post(format!("{}/v1/completions", upstream.url))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(unreachable(upstream))
    }
}

/// The error for a request to `upstream` that got no answer.
fn unreachable(upstream: &Upstream) -> impl Fn(reqwest::Error) -> UpstreamError + '_ {
    |source| UpstreamError::Unreachable {
        url: upstream.url.clone(),
        source,
    }
}

/// Turns an upstream error response into our envelope, keeping vLLM's own message
/// (it tells the client what to fix, e.g. the context length).
pub async fn upstream_rejection(response: reqwest::Response) -> ApiError {
    let status = response.status();
    let message = read_limited(response)
        .await
        .and_then(|body| vllm_error_message(&body))
        .unwrap_or_else(|| format!("The model server answered {status}."));
    if status == http::StatusCode::BAD_REQUEST {
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
            status: http::StatusCode::BAD_GATEWAY,
            kind: "upstream_error",
            message,
        }
    }
}

async fn read_limited(mut response: reqwest::Response) -> Option<Bytes> {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        let room = ERROR_BODY_LIMIT.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if room <= chunk.len() {
            break;
        }
    }
    Some(Bytes::from(body))
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
