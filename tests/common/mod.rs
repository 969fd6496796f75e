//! A real fleetgate on an ephemeral port, in front of an in-process mock-vllm, with a
//! fresh SQLite store and key per test.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]

use fleetgate::config::Config;
use fleetgate::mock_vllm::{MockConfig, MockVllm};
use fleetgate::server;
use tokio::sync::oneshot;

pub const MODEL: &str = "llama-8b";
pub const CHECKPOINT: &str = "meta-llama/Llama-3.1-8B";

pub struct Gateway {
    pub url: String,
    pub key: String,
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
        let state = server::prepare(config).await.unwrap();
        let key = fleetgate::keys::generate();
        state
            .store()
            .create_key("test", None, &key, &Default::default())
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel();
        tokio::spawn(server::serve(state, listener, async {
            let _ = rx.await;
        }));
        Self {
            url,
            key: key.secret.expose().to_owned(),
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
