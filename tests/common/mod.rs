//! Test harness of the in-process suites (`tests/it`, `tests/noisy_neighbour.rs`): a real
//! fleetgate on an ephemeral port, in front of an in-process mock-vllm, with a fresh SQLite
//! store and key per test; its router alone, without a socket ([`App`]); fresh PostgreSQL
//! databases (`postgres`); HTTP/2 frames written by hand (`h2`).
//! The tests name `AppState` and `build_router` only here. The real binaries as child
//! processes (`processes`, and the key commands in `cli`) are for the targets that run
//! them (`tests/binary.rs`, `tests/replicas.rs`, `tests/traces.rs`), which declare just
//! the submodules they use.

pub mod h2;
pub mod postgres;
pub mod private_postgres;
pub mod redis_server;
pub mod tls;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use fleetgate::admission::Limiter;
use fleetgate::admission::ledger::LedgerUsage;
use fleetgate::admission::local::LocalLimiter;
use fleetgate::config::Config;
use fleetgate::http::router::build_router;
use fleetgate::server;
use fleetgate::state::AppState;
use fleetgate::store::LimitOverrides;
use mock_vllm::{MockConfig, MockVllm};
use tokio::sync::oneshot;

pub const MODEL: &str = "llama-8b";
pub const CHECKPOINT: &str = "meta-llama/Llama-3.1-8B";
/// The name of a gateway's config file in its directory.
const CONFIG_FILE: &str = "fleetgate.toml";

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

    /// A gateway whose node takes `ms` per generated token.
    pub async fn start_slow(ms: u64) -> Self {
        Self::start_with(
            MockConfig {
                token_delay: std::time::Duration::from_millis(ms),
                ..MockConfig::default()
            },
            "",
        )
        .await
    }

    /// `extra` is appended to the config (top-level keys must come first, so it is
    /// inserted before the `[[models]]` table).
    pub async fn start_with(mock: MockConfig, extra: &str) -> Self {
        let mock = node(mock).await;
        Self::start_fleet(extra, "max_logprobs = 20", &[(&mock, "gpu-a", "")]).await
    }

    /// A gateway in front of `nodes`, configured by [`fleet_toml`] (with a fresh store);
    /// `gw.mock` is the first node.
    pub async fn start_fleet(
        top_level: &str,
        model_keys: &str,
        nodes: &[(&MockVllm, &str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let toml = fleet_toml(dir.path(), top_level, model_keys, nodes);
        Self::start_config(nodes[0].0.clone(), &toml, dir).await
    }

    pub async fn start_config(mock: MockVllm, toml: &str, dir: tempfile::TempDir) -> Self {
        Self::start_loaded(mock, Config::from_toml(toml).unwrap(), dir).await
    }

    /// [`Self::start_fleet`] with the config in a file ([`Self::config_file`]), as
    /// `fleetgate serve` has it: a reload reads that file again.
    pub async fn start_fleet_from_file(
        top_level: &str,
        model_keys: &str,
        nodes: &[(&MockVllm, &str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CONFIG_FILE);
        std::fs::write(&path, fleet_toml(dir.path(), top_level, model_keys, nodes)).unwrap();
        let config = Config::load(&path).unwrap();
        Self::start_loaded(nodes[0].0.clone(), config, dir).await
    }

    async fn start_loaded(mock: MockVllm, config: Config, dir: tempfile::TempDir) -> Self {
        let (state, limiter, key) = state(config).await;
        // Start-up asks every node what it serves (and ejects the silent ones); done
        // here so that a test's fault injection comes after it.
        fleetgate::background::prober::Prober::of(&state)
            .discover()
            .await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel();
        tokio::spawn(server::serve(state.clone(), listener, async {
            let _ = rx.await;
        }));
        Self {
            url,
            key,
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

    /// [`Gateway::get`]'s answer as JSON.
    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        self.get(path).send().await.unwrap().json().await.unwrap()
    }

    /// A new key with its own limits: (id, secret).
    pub async fn create_key(&self, limits: LimitOverrides) -> (i64, String) {
        let key = fleetgate::key_secret::generate();
        let record = self
            .state
            .store()
            .create_key("limited", None, &key, &limits)
            .await
            .unwrap();
        // In the table now, as an admin call would have it: a miss would wait for the
        // follow loop's next pull.
        self.state.keys().pull().await.unwrap();
        (record.id, key.secret.expose().to_owned())
    }

    /// A new key running at most `running` requests at once, with `queued` waiting
    /// (`None`: the default): (id, secret).
    pub async fn key_with_slots(&self, running: u32, queued: Option<u32>) -> (i64, String) {
        self.create_key(LimitOverrides {
            max_concurrent: Some(running),
            max_queued: queued,
            ..LimitOverrides::default()
        })
        .await
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

    /// `GET /metrics` (no key needed), as text.
    pub async fn metrics_text(&self) -> String {
        metrics_text(&self.client, &self.url).await
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

    /// The config file of a gateway started by [`Self::start_fleet_from_file`].
    pub fn config_file(&self) -> std::path::PathBuf {
        self.dir.path().join(CONFIG_FILE)
    }

    /// Writes [`fleet_toml`] over this gateway's config file (same store); the running
    /// gateway reads it on its next reload.
    pub fn rewrite_config(
        &self,
        top_level: &str,
        model_keys: &str,
        nodes: &[(&MockVllm, &str, &str)],
    ) {
        let toml = fleet_toml(self.dir.path(), top_level, model_keys, nodes);
        std::fs::write(self.config_file(), toml).unwrap();
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

/// The state of a gateway configured by `config`, over the store it names and an
/// in-process limiter, with one key named `test`: (state, limiter, the key's secret).
async fn state(config: Config) -> (AppState, Arc<LocalLimiter>, String) {
    let store = fleetgate::store::connect(&config.database_url)
        .await
        .unwrap();
    let writer = fleetgate::ledger::Ledger::start(Arc::clone(&store));
    let limiter = Arc::new(LocalLimiter::new(Arc::new(LedgerUsage {
        store: Arc::clone(&store),
        writer: writer.clone(),
    })));
    let keys = fleetgate::keys::KeyTable::load(Arc::clone(&store))
        .await
        .unwrap();
    let state = AppState::new(config, store, keys, writer, limiter.clone(), None).unwrap();
    let key = fleetgate::key_secret::generate();
    state
        .store()
        .create_key("test", None, &key, &LimitOverrides::default())
        .await
        .unwrap();
    state.keys().pull().await.unwrap();
    (state, limiter, key.secret.expose().to_owned())
}

/// fleetgate's router (`build_router`) with no listener and no node, over a fresh SQLite
/// store and in-process limiter: for requests answered before any upstream is asked.
/// Drive it with `tower::ServiceExt::oneshot`.
pub struct App {
    pub router: axum::Router,
    /// The secret of a valid key.
    pub key: String,
    _dir: tempfile::TempDir,
}

impl App {
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        // Nothing listens on port 9 (discard): a request that got as far as the node
        // would fail, not pass.
        let toml = format!(
            r#"
database_url = "sqlite://{db}"

[[models]]
id = "{MODEL}"
default = true

[[models.upstreams]]
url = "http://127.0.0.1:9"
gpu = "gpu-a"
"#,
            db = dir.path().join("fleetgate.db").display(),
        );
        let (state, _, key) = state(Config::from_toml(&toml).unwrap()).await;
        // As `serve` would: a request with an unknown key waits for the follow loop's
        // next pull. It ends with the test's runtime.
        tokio::spawn(Arc::clone(state.keys()).follow(tokio_util::sync::CancellationToken::new()));
        Self {
            router: build_router(state),
            key,
            _dir: dir,
        }
    }
}

/// A mock node serving [`CHECKPOINT`], otherwise as `config` says.
pub async fn node(config: MockConfig) -> MockVllm {
    MockVllm::start(MockConfig {
        served_model_name: CHECKPOINT.to_owned(),
        ..config
    })
    .await
    .unwrap()
}

/// The config of a gateway serving [`MODEL`] (its default model) from `nodes`, with its
/// SQLite store in `db_dir`. `top_level` comes before the model: top-level keys first,
/// then tables such as `[fleet]`. `model_keys` go into the `[[models]]` table. A node is
/// (mock, GPU label, further keys of its `[[models.upstreams]]` entry, e.g. `weight = 3`).
pub fn fleet_toml(
    db_dir: &Path,
    top_level: &str,
    model_keys: &str,
    nodes: &[(&MockVllm, &str, &str)],
) -> String {
    format!(
        "\ndatabase_url = \"sqlite://{db}\"\n{top_level}\n{model}",
        db = db_dir.join("fleetgate.db").display(),
        model = model_toml(MODEL, &format!("default = true\n{model_keys}"), nodes),
    )
}

/// One `[[models]]` table: the model `id`, `model_keys`, and its `nodes` as in
/// [`fleet_toml`]. Appended to [`fleet_toml`]'s config, a second model.
pub fn model_toml(id: &str, model_keys: &str, nodes: &[(&MockVllm, &str, &str)]) -> String {
    let upstreams: String = nodes
        .iter()
        .map(|(node, gpu, keys)| {
            format!(
                "\n[[models.upstreams]]\nurl = \"{}\"\ngpu = \"{gpu}\"\n{keys}\n",
                node.url()
            )
        })
        .collect();
    format!("\n[[models]]\nid = \"{id}\"\n{model_keys}\n{upstreams}")
}

/// `GET {base_url}/metrics` (no key), as text: a gateway's or a mock node's.
pub async fn metrics_text(client: &reqwest::Client, base_url: &str) -> String {
    client
        .get(format!("{base_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// One sample line of the Prometheus text format: metric name, labels, value.
#[derive(Debug)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses the sample lines of the text format (label values here never hold quotes,
/// commas or escapes).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("a value");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.strip_suffix('}').expect("closing brace")),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|pair| !pair.is_empty())
                .map(|pair| {
                    let (k, v) = pair.split_once('=').expect("label=value");
                    (k.to_owned(), v.trim_matches('"').to_owned())
                })
                .collect();
            Sample {
                name: name.to_owned(),
                labels,
                value: value.parse().expect("a number"),
            }
        })
        .collect()
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
