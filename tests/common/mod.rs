//! Test harness: a real fleetgate on an ephemeral port, in front of an in-process
//! mock-vllm, with a fresh SQLite store and key per test; and the real binaries as child
//! processes (`processes`); fresh PostgreSQL databases (`postgres`).

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]

pub mod postgres;
pub mod processes;

use std::sync::Arc;

use fleetgate::admission::Limiter;
use fleetgate::admission::ledger::LedgerUsage;
use fleetgate::admission::local::LocalLimiter;
use fleetgate::app::AppState;
use fleetgate::config::Config;
use fleetgate::mock_vllm::{MockConfig, MockVllm};
use fleetgate::server;
use fleetgate::store::LimitOverrides;
use tokio::sync::oneshot;

pub const MODEL: &str = "llama-8b";
pub const CHECKPOINT: &str = "meta-llama/Llama-3.1-8B";

pub struct Gateway {
    pub url: String,
    pub key: String,
    pub state: AppState,
    pub limiter: Arc<LocalLimiter>,
    pub mock: MockVllm,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    dir: tempfile::TempDir,
}

impl Gateway {
    pub async fn start() -> Self {
        Self::start_with(MockConfig::default(), "").await
    }

    /// `extra` is appended to the config (top-level keys must come first, so it is
    /// inserted before the `[[models]]` table).
    pub async fn start_with(mock: MockConfig, extra: &str) -> Self {
        let mock = MockVllm::start(MockConfig {
            served_model_name: CHECKPOINT.to_owned(),
            ..mock
        })
        .await
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let toml = format!(
            r#"
database_url = "sqlite://{db}"
{extra}

[[models]]
id = "{MODEL}"
default = true
max_logprobs = 20

[[models.upstreams]]
url = "{url}"
gpu = "gpu-a"
"#,
            db = dir.path().join("fleetgate.db").display(),
            url = mock.url(),
        );
        Self::start_config(mock, &toml, dir).await
    }

    pub async fn start_config(mock: MockVllm, toml: &str, dir: tempfile::TempDir) -> Self {
        let config = Config::from_toml(toml).unwrap();
        let store = fleetgate::store::connect(&config.database_url)
            .await
            .unwrap();
        let limiter = Arc::new(LocalLimiter::new(Arc::new(LedgerUsage(Arc::clone(&store)))));
        let state = AppState::new(config, store, limiter.clone()).unwrap();
        let key = fleetgate::keys::generate();
        state
            .store()
            .create_key("test", None, &key, &LimitOverrides::default())
            .await
            .unwrap();
        // Start-up asks every node what it serves (and ejects the silent ones); done
        // here so that a test's fault injection comes after it.
        state.discover_upstreams().await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel();
        tokio::spawn(server::serve(state.clone(), listener, async {
            let _ = rx.await;
        }));
        Self {
            url,
            key: key.secret.expose().to_owned(),
            state,
            limiter,
            mock,
            client: reqwest::Client::builder().no_gzip().build().unwrap(),
            shutdown: Some(tx),
            dir,
        }
    }

    /// `POST /v1/completions` with the test key and a JSON content type.
    pub fn complete(&self, body: &str) -> reqwest::RequestBuilder {
        self.complete_as(&self.key, body)
    }

    /// `POST /v1/completions` with a JSON content type and `Authorization: Bearer {key}`.
    pub fn complete_as(&self, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}/v1/completions", self.url))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body.to_owned())
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.client
            .get(format!("{}{path}", self.url))
            .bearer_auth(&self.key)
    }

    /// A new key with its own limits: (id, secret).
    pub async fn create_key(&self, limits: LimitOverrides) -> (i64, String) {
        let key = fleetgate::keys::generate();
        let record = self
            .state
            .store()
            .create_key("limited", None, &key, &limits)
            .await
            .unwrap();
        (record.id, key.secret.expose().to_owned())
    }

    /// Waits (on the limiter's change notifications, bounded) until the key has this
    /// many requests running and waiting.
    pub async fn wait_occupancy(&self, key_id: i64, running: u32, queued: u32) {
        let mut changes = self.limiter.changes();
        let reached = async {
            loop {
                if self.limiter.occupancy(key_id).await.unwrap() == (running, queued) {
                    return;
                }
                changes.changed().await.unwrap();
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), reached)
            .await
            .unwrap_or_else(|_| {
                panic!("occupancy never reached ({running} running, {queued} queued)")
            });
    }

    /// `GET /v1/usage` for a key.
    pub async fn usage(&self, key: &str) -> serde_json::Value {
        let response = self
            .client
            .get(format!("{}/v1/usage", self.url))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.json().await.unwrap()
    }

    pub fn db_path(&self) -> std::path::PathBuf {
        self.dir.path().join("fleetgate.db")
    }

    /// The bodies of the completion requests the upstream received, as JSON.
    pub fn upstream_completions(&self) -> Vec<serde_json::Value> {
        self.mock
            .received()
            .into_iter()
            .filter(|r| r.path == "/v1/completions")
            .map(|r| r.json())
            .collect()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Asserts the OpenAI envelope and returns the parsed body.
pub async fn expect_error(
    response: reqwest::Response,
    status: u16,
    code: &str,
) -> serde_json::Value {
    assert_eq!(response.status().as_u16(), status, "status");
    let header_id = response
        .headers()
        .get("x-request-id")
        .expect("x-request-id on every response")
        .to_str()
        .unwrap()
        .to_owned();
    let body: serde_json::Value = response.json().await.expect("a JSON error body");
    assert_eq!(body["error"]["code"], code, "error.code in {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "message in {body}"
    );
    assert!(body["error"]["type"].is_string(), "type in {body}");
    assert_eq!(
        body["request_id"],
        header_id.as_str(),
        "request_id matches X-Request-Id"
    );
    body
}
