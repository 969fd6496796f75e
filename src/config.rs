//! Configuration: built-in defaults, then one TOML file, then `FLEETGATE_*` environment
//! variables (nested keys joined with `__`, e.g. `FLEETGATE_UPSTREAM__CONNECT_TIMEOUT_MS`).
//! Unknown keys anywhere are a start-up error that names them; `validate` checks the
//! cross-field rules after loading.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::Deserialize;

mod jobs;

pub use jobs::JobSettings;

use crate::contract::LOGPROBS_LIMIT;
use crate::fleet::PREFIX_BLOCK_BYTES;

/// Environment variables that are read elsewhere and are not configuration keys.
const ENV_NOT_CONFIG: &[&str] = &["config"];

/// The most of a prompt's start that prefix routing hashes: 64 KiB.
const MAX_PREFIX_BYTES: usize = 64 * 1024;

/// The most prefixes prefix routing may remember per model: 16 Mi (128 MiB).
const MAX_PREFIX_TRACKED: usize = 16 * 1024 * 1024;

/// The longest duration any `*_ms` setting may have: 7 days.
const MAX_DURATION_MS: u64 = 7 * 24 * 3_600_000;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address the gateway listens on.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// A second listener with only `/metrics`, `/health`, `/ready` and `/live`, e.g. on an
    /// internal interface for the scraper (both stay on `listen` too).
    #[serde(default)]
    pub ops_listen: Option<SocketAddr>,
    /// `sqlite://path/file.db` (created if missing) or `postgres://user@host/db`. A
    /// relative SQLite path is relative to the config file's directory, not to where
    /// the command runs, so `serve` and `keys` always open the same file.
    #[serde(default = "default_database_url")]
    pub database_url: String,
    /// Largest accepted request body; larger ones get 413.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// On SIGTERM/Ctrl-C, how long in-flight requests may take to finish before their
    /// connections are closed (usage and the request log are written either way).
    #[serde(default = "default_shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// Log format: `text` for people, `json` for machines.
    #[serde(default)]
    pub log_format: LogFormat,
    /// Client connections: how many may be open, how long a request head and body
    /// may take to arrive.
    #[serde(default)]
    pub connections: ConnectionSettings,
    #[serde(default)]
    pub upstream: UpstreamSettings,
    /// Health probing, ejection, the fleet queue and the request window.
    #[serde(default)]
    pub fleet: FleetSettings,
    /// Default per-key limits; a key may override each of them.
    #[serde(default)]
    pub limits: LimitDefaults,
    /// Shared live counters for several replicas (`redis://host:6379/0`). Without it the
    /// counters live in this process, which is exact for a single replica only.
    #[serde(default)]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key fleetgate writes, so deployments can share a server.
    #[serde(default = "default_redis_key_prefix")]
    pub redis_key_prefix: String,
    /// Bearer token for the `/admin` API; without it the admin API is off (404).
    #[serde(default)]
    pub admin_token: Option<AdminToken>,
    /// OpenTelemetry traces, exported over OTLP; off unless `otlp_endpoint` is set.
    #[serde(default)]
    pub traces: TraceSettings,
    /// The Workbench and Loom: how long their recovery checkpoints are kept.
    #[serde(default)]
    pub workbench: WorkbenchSettings,
    /// Completion jobs: workers, long-polls, retention.
    #[serde(default)]
    pub jobs: JobSettings,
    pub models: Vec<ModelConfig>,
    /// The file this was loaded from, which a reload reads again (`reload.rs`); `None`
    /// for a config built from a string.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// The Workbench and Loom (`src/workbench`). Saved prompts, runs and trees stay until
/// deleted; a run not yet saved is a recovery checkpoint, kept this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkbenchSettings {
    /// Seconds a recovery checkpoint lives after it was written (the Privacy section of
    /// the API reference promises seven days).
    #[serde(default = "default_checkpoint_ttl_secs")]
    pub checkpoint_ttl_secs: u64,
    /// Seconds between two sweeps that delete expired checkpoints. (An expired one is
    /// invisible at once; the sweep only frees its storage.)
    #[serde(default = "default_checkpoint_sweep_secs")]
    pub checkpoint_sweep_secs: u64,
}

impl Default for WorkbenchSettings {
    fn default() -> Self {
        Self {
            checkpoint_ttl_secs: default_checkpoint_ttl_secs(),
            checkpoint_sweep_secs: default_checkpoint_sweep_secs(),
        }
    }
}

/// Where and how much of the request path is traced (`src/traces.rs`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSettings {
    /// The collector's OTLP/HTTP base URL, e.g. `http://otel-collector:4318`; spans go to
    /// `{otlp_endpoint}/v1/traces` as protobuf. Without it nothing is traced or exported
    /// and no `traceparent` is sent to the nodes.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// Share of new traces kept, 0 to 1. A request that arrives with a `traceparent`
    /// follows its sampled flag instead (parent-based sampling), so a trace is kept or
    /// dropped whole across client, gateway and vLLM.
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: f64,
}

impl Default for TraceSettings {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: default_service_name(),
            sample_ratio: default_sample_ratio(),
        }
    }
}

impl TraceSettings {
    /// Whether requests are traced (an endpoint is configured).
    pub fn enabled(&self) -> bool {
        self.otlp_endpoint.is_some()
    }
}

/// Limits every key gets unless it overrides them.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitDefaults {
    /// `false` turns admission off: no budget, rate or queue is enforced (usage is
    /// still metered into the ledger).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Prompt + completion tokens per calendar month (UTC), reset on the 1st. The name
    /// of the CLI flag, the admin API and `/v1/usage`; the old `monthly_budget_tokens`
    /// is still read.
    #[serde(default = "default_monthly_budget", alias = "monthly_budget_tokens")]
    pub monthly_budget: u64,
    /// Request starts per minute (bursts up to this many allowed).
    #[serde(default = "default_rpm")]
    pub requests_per_minute: u32,
    /// Requests running at once per key.
    #[serde(default = "default_max_concurrent")]
    pub max_concurrent: u32,
    /// Requests waiting per key beyond the running ones; more get 429 `queue_full`.
    #[serde(default = "default_max_queued")]
    pub max_queued: u32,
}

impl Default for LimitDefaults {
    fn default() -> Self {
        Self {
            enabled: true,
            monthly_budget: default_monthly_budget(),
            requests_per_minute: default_rpm(),
            max_concurrent: default_max_concurrent(),
            max_queued: default_max_queued(),
        }
    }
}

/// The admin API's bearer token; never printed.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct AdminToken(String);

impl AdminToken {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(…)")
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// What a client connection may take: a slow or silent client must not hold a socket,
/// a task and memory for as long as it likes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionSettings {
    /// Client connections open at once; a connection beyond is closed as soon as it is
    /// accepted (counted in `/metrics`, logged).
    #[serde(default = "default_max_open_connections")]
    pub max_open: usize,
    /// A request's head (start line and headers) must have arrived this long after the
    /// connection opened or its previous response ended, else the connection is closed;
    /// so this is also how long an idle keep-alive connection is kept (HTTP/1).
    #[serde(default = "default_header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// A request's body must have arrived this long after its head was read, else
    /// 408 `request_timeout`.
    #[serde(default = "default_body_read_timeout_ms")]
    pub body_read_timeout_ms: u64,
    /// Connection threads: each serves the connections given to it (a new one goes to
    /// the thread with the fewest open) on a single-threaded runtime of its own, so that
    /// a request never waits for a hand-off between threads. `0` serves them on the
    /// process's shared worker threads instead. Default: one per CPU.
    #[serde(default = "default_connection_threads")]
    pub threads: usize,
}

impl Default for ConnectionSettings {
    fn default() -> Self {
        Self {
            max_open: default_max_open_connections(),
            header_read_timeout_ms: default_header_read_timeout_ms(),
            body_read_timeout_ms: default_body_read_timeout_ms(),
            threads: default_connection_threads(),
        }
    }
}

/// How fleetgate talks to the vLLM servers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSettings {
    /// Time allowed to open a TCP connection to an upstream.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Pooled connections idle longer than this are closed. vLLM (uvicorn) closes idle
    /// keep-alive connections after 5 s; staying below avoids reusing a connection the
    /// server is closing (a reset on the next request).
    #[serde(default = "default_pool_idle_timeout_ms")]
    pub pool_idle_timeout_ms: u64,
}

impl Default for UpstreamSettings {
    fn default() -> Self {
        Self {
            connect_timeout_ms: default_connect_timeout_ms(),
            pool_idle_timeout_ms: default_pool_idle_timeout_ms(),
        }
    }
}

/// How fleetgate watches its nodes and waits for them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSettings {
    /// How often every node's `/health` and `/v1/models` are probed.
    #[serde(default = "default_probe_interval_ms")]
    pub probe_interval_ms: u64,
    /// A probe not answered within this counts as a failure.
    #[serde(default = "default_probe_timeout_ms")]
    pub probe_timeout_ms: u64,
    /// A failed node is ejected for this long, doubling with each failure in a row up
    /// to `eject_max_ms`; after that a successful probe re-admits it.
    #[serde(default = "default_eject_base_ms")]
    pub eject_base_ms: u64,
    #[serde(default = "default_eject_max_ms")]
    pub eject_max_ms: u64,
    /// Requests per model that may wait for a node below its `max_in_flight`; more
    /// get 503 at once.
    #[serde(default = "default_queue_size")]
    pub queue_size: u32,
    /// The longest a request waits in that queue before 503.
    #[serde(default = "default_queue_timeout_ms")]
    pub queue_timeout_ms: u64,
    /// How long a non-streaming request may take upstream before 504
    /// `upstream_deadline`; omitted `max_tokens` are cut to what fits in it.
    #[serde(default = "default_request_window_ms")]
    pub request_window_ms: u64,
    /// During a cold boot, how often a keep-alive byte is sent to the waiting client.
    #[serde(default = "default_keepalive_interval_ms")]
    pub keepalive_interval_ms: u64,
    /// How a model's requests choose their node, unless the model says otherwise:
    /// `prefix` (the node that owns the prompt's prefix, so vLLM's prefix cache is
    /// reused) or `load` (the least-loaded of two random nodes).
    #[serde(default)]
    pub routing: Routing,
    /// `prefix` routing: how much of a prompt's start decides its node. Prompts whose
    /// first `prefix_bytes` bytes agree (token ids: 4 bytes each) go to the same node;
    /// counted in whole blocks of 256 bytes.
    #[serde(default = "default_prefix_bytes")]
    pub prefix_bytes: usize,
    /// `prefix` routing: the owner of a prefix is passed over for the least-loaded pick
    /// when its load (requests in flight plus those waiting in its vLLM, over its weight)
    /// is more than `prefix_imbalance_abs` above the lightest node's and more than
    /// `prefix_imbalance_rel` times it (and always when it is at `max_in_flight`).
    #[serde(default = "default_prefix_imbalance_abs")]
    pub prefix_imbalance_abs: f64,
    #[serde(default = "default_prefix_imbalance_rel")]
    pub prefix_imbalance_rel: f64,
    /// `prefix` routing: how many recently seen prefixes each replica remembers per
    /// model (8 bytes each). Only a prefix seen before goes to its owner; a new one takes
    /// the least-loaded pick.
    #[serde(default = "default_prefix_tracked")]
    pub prefix_tracked: usize,
}

/// How a model's requests choose their node (`fleet.routing`, `models.routing`).
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Routing {
    /// The default: it measured better (`benches/prefix-routing`).
    #[default]
    Prefix,
    Load,
}

impl Default for FleetSettings {
    fn default() -> Self {
        Self {
            probe_interval_ms: default_probe_interval_ms(),
            probe_timeout_ms: default_probe_timeout_ms(),
            eject_base_ms: default_eject_base_ms(),
            eject_max_ms: default_eject_max_ms(),
            queue_size: default_queue_size(),
            queue_timeout_ms: default_queue_timeout_ms(),
            request_window_ms: default_request_window_ms(),
            keepalive_interval_ms: default_keepalive_interval_ms(),
            routing: Routing::default(),
            prefix_bytes: default_prefix_bytes(),
            prefix_imbalance_abs: default_prefix_imbalance_abs(),
            prefix_imbalance_rel: default_prefix_imbalance_rel(),
            prefix_tracked: default_prefix_tracked(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The short id clients send, e.g. `llama-8b`.
    pub id: String,
    /// Requests without `model` go to the default model; exactly one model is the default.
    #[serde(default)]
    pub default: bool,
    /// Largest `logprobs` accepted for this model (published as `capabilities.max_logprobs`).
    /// Keep it at or below the server's `--max-logprobs`.
    #[serde(default = "default_max_logprobs")]
    pub max_logprobs: u32,
    /// Tokens one sequence decodes per second, at worst: with `fleet.request_window_ms`
    /// it decides how many tokens a non-streaming request can get in time.
    #[serde(default = "default_decode_tokens_per_second")]
    pub decode_tokens_per_second: f64,
    /// Scale to zero: called (`POST`) when no node of the model is up; a 2xx answer
    /// confirms that a boot has started.
    #[serde(default)]
    pub wake_url: Option<String>,
    /// How long a woken model may take to come up before waiting requests fail.
    #[serde(default = "default_boot_timeout_ms")]
    pub boot_timeout_ms: u64,
    /// Called (`POST`) to put the model to sleep once it is idle (see `keep_warm_ms`).
    #[serde(default)]
    pub sleep_url: Option<String>,
    /// With `sleep_url`: the model sleeps once nothing has run on it for
    /// `idle_sleep_ms` and no `X-Acs-Workload: interactive` request came for
    /// `keep_warm_ms`.
    #[serde(default = "default_keep_warm_ms")]
    pub keep_warm_ms: u64,
    #[serde(default = "default_idle_sleep_ms")]
    pub idle_sleep_ms: u64,
    /// Overrides `fleet.routing` for this model.
    #[serde(default)]
    pub routing: Option<Routing>,
    pub upstreams: Vec<UpstreamConfig>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL of a vLLM server, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// Label returned in `X-Acs-Upstream-Gpu`.
    pub gpu: String,
    /// Relative capacity against the model's other upstreams (a node with weight 2 is
    /// given twice the in-flight requests of one with weight 1).
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Most requests sent to this node at once; beyond it requests wait in the fleet
    /// queue. Unlimited by default: vLLM queues well by itself.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}
fn default_database_url() -> String {
    "sqlite://data/fleetgate.db".to_owned()
}
fn default_max_body_bytes() -> usize {
    32 * 1024 * 1024
}
fn default_connect_timeout_ms() -> u64 {
    2_000
}
fn default_pool_idle_timeout_ms() -> u64 {
    3_000
}
fn default_max_logprobs() -> u32 {
    20
}
fn default_weight() -> u32 {
    1
}
fn default_probe_interval_ms() -> u64 {
    2_000
}
fn default_probe_timeout_ms() -> u64 {
    5_000
}
fn default_eject_base_ms() -> u64 {
    1_000
}
fn default_eject_max_ms() -> u64 {
    30_000
}
fn default_queue_size() -> u32 {
    256
}
fn default_queue_timeout_ms() -> u64 {
    30_000
}
fn default_request_window_ms() -> u64 {
    600_000
}
fn default_keepalive_interval_ms() -> u64 {
    10_000
}
fn default_prefix_bytes() -> usize {
    1024
}
fn default_prefix_imbalance_abs() -> f64 {
    16.0
}
fn default_prefix_imbalance_rel() -> f64 {
    1.5
}
fn default_prefix_tracked() -> usize {
    16_384
}
/// 26 tokens/s over the default 600 s window: ~15,600 tokens.
fn default_decode_tokens_per_second() -> f64 {
    26.0
}
fn default_boot_timeout_ms() -> u64 {
    600_000
}
fn default_keep_warm_ms() -> u64 {
    30 * 60_000
}
fn default_idle_sleep_ms() -> u64 {
    5 * 60_000
}
fn default_shutdown_grace_ms() -> u64 {
    30_000
}
fn default_max_open_connections() -> usize {
    10_000
}
fn default_header_read_timeout_ms() -> u64 {
    60_000
}
fn default_body_read_timeout_ms() -> u64 {
    120_000
}
/// More connection threads than this is a typo, not a machine.
const MAX_CONNECTION_THREADS: usize = 1024;

fn default_connection_threads() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}
fn default_true() -> bool {
    true
}
fn default_monthly_budget() -> u64 {
    10_000_000
}
fn default_rpm() -> u32 {
    600
}
fn default_max_concurrent() -> u32 {
    16
}
fn default_max_queued() -> u32 {
    64
}
fn default_redis_key_prefix() -> String {
    "fleetgate".to_owned()
}
fn default_checkpoint_ttl_secs() -> u64 {
    7 * 24 * 3600
}
fn default_checkpoint_sweep_secs() -> u64 {
    3600
}
fn default_service_name() -> String {
    "fleetgate".to_owned()
}
fn default_sample_ratio() -> f64 {
    1.0
}

/// `url` with a relative SQLite file path made relative to `dir`; any other URL as it is.
fn sqlite_relative_to(url: &str, dir: &Path) -> String {
    let Some(rest) = url.strip_prefix("sqlite:") else {
        return url.to_owned();
    };
    let file = rest.strip_prefix("//").unwrap_or(rest);
    if file.is_empty() || file.starts_with(':') || Path::new(file).is_absolute() {
        return url.to_owned();
    }
    format!("sqlite://{}", dir.join(file).display())
}

/// figment's errors, said once each as `key: problem` — without its profile prefix
/// (`default.`), its doubled quoting of expected names, or the file name the caller
/// already gives; a value from the environment says so.
fn describe(errors: figment::Error) -> String {
    use figment::Source;
    use figment::error::Kind;
    let said: Vec<String> = errors
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let problem = match &e.kind {
                Kind::UnknownField(found, expected) => format!(
                    "unknown key `{found}`; expected one of: {}",
                    expected.join(", ")
                ),
                Kind::UnknownVariant(found, expected) => format!(
                    "unknown value `{found}`; expected one of: {}",
                    expected.join(", ")
                ),
                other => other.to_string(),
            };
            let origin = match e.metadata.as_ref() {
                Some(meta) if !matches!(meta.source, Some(Source::File(_))) => {
                    format!(" (from {})", meta.name)
                }
                _ => String::new(),
            };
            let at = match &e.kind {
                // The unknown key is named in the problem; say where it sits.
                Kind::UnknownField(..) if e.path.len() > 1 => {
                    format!("in [{}]: ", e.path[..e.path.len() - 1].join("."))
                }
                Kind::UnknownField(..) => String::new(),
                _ if key.is_empty() => String::new(),
                _ => format!("{key}: "),
            };
            format!("{at}{problem}{origin}")
        })
        .collect();
    said.join("; ")
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Every problem figment found, one per `; `, each naming its key.
    #[error("{0}")]
    Load(String),
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    /// Loads `path` (TOML) with `FLEETGATE_*` overrides, then validates.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        if !path.exists() {
            return Err(ConfigError::Invalid(
                "no such file (name another with --config or FLEETGATE_CONFIG)".to_owned(),
            ));
        }
        let mut config = Self::from_figment(Figment::new().merge(Toml::file_exact(path)))?;
        let dir = path.parent().unwrap_or(Path::new(""));
        let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        config.database_url = sqlite_relative_to(&config.database_url, &dir);
        config.source = Some(path.to_owned());
        Ok(config)
    }

    /// Parses a TOML document with `FLEETGATE_*` overrides, then validates.
    pub fn from_toml(toml: &str) -> Result<Self, ConfigError> {
        Self::from_figment(Figment::new().merge(Toml::string(toml)))
    }

    fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let env = Env::prefixed("FLEETGATE_").split("__").filter(|key| {
            !ENV_NOT_CONFIG
                .iter()
                .any(|k| key.as_str().eq_ignore_ascii_case(k))
        });
        let config: Config = figment
            .merge(env)
            .extract()
            .map_err(|e| ConfigError::Load(describe(e)))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |msg: String| Err(ConfigError::Invalid(msg));
        if self.workbench.checkpoint_sweep_secs == 0 {
            return invalid("workbench.checkpoint_sweep_secs must be at least 1".into());
        }
        if i64::try_from(self.workbench.checkpoint_ttl_secs).is_err() {
            return invalid("workbench.checkpoint_ttl_secs is too large".into());
        }
        if self.models.is_empty() {
            return invalid("at least one [[models]] entry is required".into());
        }
        if self.max_body_bytes == 0 {
            return invalid("max_body_bytes must be at least 1".into());
        }
        if self.limits.requests_per_minute == 0 || self.limits.max_concurrent == 0 {
            return invalid(
                "limits.requests_per_minute and limits.max_concurrent must be at least 1".into(),
            );
        }
        if self.admin_token.as_ref().is_some_and(|t| t.0.len() < 16) {
            return invalid("admin_token must be at least 16 characters".into());
        }
        let mut ids = HashSet::new();
        for model in &self.models {
            if model.id.is_empty() {
                return invalid("models.id must not be empty".into());
            }
            if !ids.insert(model.id.as_str()) {
                return invalid(format!("models.id '{}' appears twice", model.id));
            }
            if model.max_logprobs > LOGPROBS_LIMIT {
                return invalid(format!(
                    "models.max_logprobs of '{}' must be at most {LOGPROBS_LIMIT} (got {})",
                    model.id, model.max_logprobs
                ));
            }
            if model.upstreams.is_empty() {
                return invalid(format!(
                    "model '{}' needs at least one [[models.upstreams]] entry",
                    model.id
                ));
            }
            if !(model.decode_tokens_per_second.is_finite() && model.decode_tokens_per_second > 0.0)
            {
                return invalid(format!(
                    "models.decode_tokens_per_second of '{}' must be above 0",
                    model.id
                ));
            }
            if model.sleep_url.is_some() && model.wake_url.is_none() {
                return invalid(format!(
                    "model '{}' has a sleep_url but no wake_url to wake it again",
                    model.id
                ));
            }
            for hook in [&model.wake_url, &model.sleep_url].into_iter().flatten() {
                if !is_http_url(hook) {
                    return invalid(format!(
                        "models.wake_url/sleep_url of '{}' must be an http(s) URL (got '{hook}')",
                        model.id
                    ));
                }
            }
            for upstream in &model.upstreams {
                if upstream.max_in_flight == Some(0) {
                    return invalid(format!(
                        "models.upstreams.max_in_flight of '{}' must be at least 1",
                        model.id
                    ));
                }
                if upstream.weight == 0 {
                    return invalid(format!(
                        "models.upstreams.weight of '{}' must be at least 1",
                        model.id
                    ));
                }
                if !is_http_url(&upstream.url) {
                    return invalid(format!(
                        "models.upstreams.url of '{}' must be an http(s) URL (got '{}')",
                        model.id, upstream.url
                    ));
                }
            }
        }
        let connections = &self.connections;
        if connections.max_open == 0
            || connections.header_read_timeout_ms == 0
            || connections.body_read_timeout_ms == 0
        {
            return invalid(
                "connections.max_open, header_read_timeout_ms and body_read_timeout_ms must be at least 1".into(),
            );
        }
        if connections.threads > MAX_CONNECTION_THREADS {
            return invalid(format!(
                "connections.threads must be at most {MAX_CONNECTION_THREADS} (got {}; 0 serves connections on the shared worker threads)",
                connections.threads
            ));
        }
        let fleet = &self.fleet;
        if fleet.probe_interval_ms == 0
            || fleet.probe_timeout_ms == 0
            || fleet.eject_base_ms == 0
            || fleet.request_window_ms == 0
            || fleet.keepalive_interval_ms == 0
        {
            return invalid(
                "fleet.probe_interval_ms, probe_timeout_ms, eject_base_ms, request_window_ms and keepalive_interval_ms must be at least 1".into(),
            );
        }
        let jobs = &self.jobs;
        if jobs.lease_ms < 300 || jobs.poll_interval_ms == 0 || jobs.sweep_interval_ms == 0 {
            return invalid(
                "jobs.lease_ms must be at least 300, jobs.poll_interval_ms and sweep_interval_ms at least 1".into(),
            );
        }
        if jobs.max_waiters > jobs::MAX_WAITERS {
            return invalid(format!(
                "jobs.max_waiters must be at most {} (got {})",
                jobs::MAX_WAITERS,
                jobs.max_waiters
            ));
        }
        if jobs.max_attempts == 0 || jobs.run_timeout_ms == 0 {
            return invalid("jobs.max_attempts and jobs.run_timeout_ms must be at least 1".into());
        }
        let durations = [
            ("shutdown_grace_ms", self.shutdown_grace_ms),
            (
                "connections.header_read_timeout_ms",
                connections.header_read_timeout_ms,
            ),
            (
                "connections.body_read_timeout_ms",
                connections.body_read_timeout_ms,
            ),
            ("fleet.probe_interval_ms", fleet.probe_interval_ms),
            ("fleet.probe_timeout_ms", fleet.probe_timeout_ms),
            ("fleet.eject_base_ms", fleet.eject_base_ms),
            ("fleet.eject_max_ms", fleet.eject_max_ms),
            ("fleet.queue_timeout_ms", fleet.queue_timeout_ms),
            ("fleet.request_window_ms", fleet.request_window_ms),
            ("fleet.keepalive_interval_ms", fleet.keepalive_interval_ms),
        ]
        .into_iter()
        .chain(self.jobs.durations());
        let model_durations = self.models.iter().flat_map(|m| {
            [
                ("models.boot_timeout_ms", m.boot_timeout_ms),
                ("models.keep_warm_ms", m.keep_warm_ms),
                ("models.idle_sleep_ms", m.idle_sleep_ms),
            ]
        });
        for (name, ms) in durations.chain(model_durations) {
            if ms > MAX_DURATION_MS {
                return invalid(format!(
                    "{name} must be at most {MAX_DURATION_MS} (7 days; got {ms})"
                ));
            }
        }
        if !(PREFIX_BLOCK_BYTES..=MAX_PREFIX_BYTES).contains(&fleet.prefix_bytes) {
            return invalid(format!(
                "fleet.prefix_bytes must be between {PREFIX_BLOCK_BYTES} and {MAX_PREFIX_BYTES} (got {})",
                fleet.prefix_bytes
            ));
        }
        if !(1..=MAX_PREFIX_TRACKED).contains(&fleet.prefix_tracked) {
            return invalid(format!(
                "fleet.prefix_tracked must be between 1 and {MAX_PREFIX_TRACKED} (got {})",
                fleet.prefix_tracked
            ));
        }
        if !(fleet.prefix_imbalance_abs.is_finite() && fleet.prefix_imbalance_abs >= 0.0) {
            return invalid(format!(
                "fleet.prefix_imbalance_abs must be 0 or more (got {})",
                fleet.prefix_imbalance_abs
            ));
        }
        if !(fleet.prefix_imbalance_rel.is_finite() && fleet.prefix_imbalance_rel >= 1.0) {
            return invalid(format!(
                "fleet.prefix_imbalance_rel must be at least 1 (got {})",
                fleet.prefix_imbalance_rel
            ));
        }
        let traces = &self.traces;
        if !(0.0..=1.0).contains(&traces.sample_ratio) {
            return invalid(format!(
                "traces.sample_ratio must be between 0 and 1 (got {})",
                traces.sample_ratio
            ));
        }
        if let Some(endpoint) = traces.otlp_endpoint.as_deref()
            && !is_http_url(endpoint)
        {
            return invalid(format!(
                "traces.otlp_endpoint must be an http(s) URL (got '{endpoint}')"
            ));
        }
        if fleet.eject_max_ms < fleet.eject_base_ms {
            return invalid("fleet.eject_max_ms must be at least fleet.eject_base_ms".into());
        }
        let defaults = self.models.iter().filter(|m| m.default).count();
        // A single model is the default whether or not it says so.
        if defaults != 1 && !(defaults == 0 && self.models.len() == 1) {
            return invalid(format!(
                "exactly one model must have default = true (found {defaults})"
            ));
        }
        Ok(())
    }

    /// Index of the default model (validated to exist).
    pub fn default_model_index(&self) -> usize {
        self.models.iter().position(|m| m.default).unwrap_or(0)
    }
}

fn is_http_url(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(fleet: &str, model: &str) -> Result<Config, ConfigError> {
        Config::from_toml(&format!(
            "[fleet]\n{fleet}\n[[models]]\nid = \"m\"\n{model}\n[[models.upstreams]]\nurl = \"http://127.0.0.1:1\"\ngpu = \"g\"\n"
        ))
    }

    fn refusal(fleet: &str) -> String {
        with(fleet, "").map(|_| ()).unwrap_err().to_string()
    }

    #[test]
    fn routing_is_set_fleet_wide_and_overridden_per_model() {
        let config = with("routing = \"load\"", "routing = \"prefix\"").unwrap();
        assert_eq!(config.fleet.routing, Routing::Load);
        assert_eq!(config.models[0].routing, Some(Routing::Prefix));
        let defaults = with("", "").unwrap();
        assert_eq!(
            (defaults.fleet.routing, defaults.models[0].routing),
            (Routing::Prefix, None)
        );
        assert!(refusal("routing = \"random\"").contains("random"));
    }

    #[test]
    fn prefix_settings_out_of_range_are_refused_by_name() {
        assert!(refusal("prefix_bytes = 100").contains("fleet.prefix_bytes must be between 256"));
        assert!(refusal("prefix_imbalance_abs = -1").contains("fleet.prefix_imbalance_abs"));
        assert!(refusal("prefix_imbalance_rel = 0.5").contains("fleet.prefix_imbalance_rel"));
        assert!(refusal("prefix_tracked = 0").contains("fleet.prefix_tracked must be between 1"));
        assert!(with("prefix_imbalance_abs = 0\nprefix_imbalance_rel = 1", "").is_ok());
    }

    #[test]
    fn a_relative_sqlite_path_is_relative_to_the_config_directory() {
        let dir = Path::new("/etc/fleetgate");
        assert_eq!(
            sqlite_relative_to("sqlite://data/fleetgate.db", dir),
            "sqlite:///etc/fleetgate/data/fleetgate.db"
        );
        assert_eq!(
            sqlite_relative_to("sqlite:fg.db?mode=rwc", dir),
            "sqlite:///etc/fleetgate/fg.db?mode=rwc"
        );
        for kept in [
            "sqlite:///var/lib/fleetgate/fleetgate.db",
            "sqlite::memory:",
            "sqlite://:memory:",
            "sqlite://",
            "postgres://fg@db/fleetgate",
        ] {
            assert_eq!(sqlite_relative_to(kept, dir), kept);
        }
    }

    fn connections(keys: &str) -> Result<Config, ConfigError> {
        Config::from_toml(&format!(
            "[connections]\n{keys}\n[[models]]\nid = \"m\"\n[[models.upstreams]]\nurl = \"http://127.0.0.1:1\"\ngpu = \"g\"\n"
        ))
    }

    #[test]
    fn connection_threads_default_to_one_per_cpu_and_are_bounded() {
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        assert_eq!(connections("").unwrap().connections.threads, cpus);
        assert_eq!(connections("threads = 0").unwrap().connections.threads, 0);
        let refused = connections("threads = 100000")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("connections.threads must be at most 1024 (got 100000"),
            "{refused}"
        );
    }

    fn traces(keys: &str) -> Result<Config, ConfigError> {
        Config::from_toml(&format!(
            "[traces]\n{keys}\n[[models]]\nid = \"m\"\n[[models.upstreams]]\nurl = \"http://127.0.0.1:1\"\ngpu = \"g\"\n"
        ))
    }

    #[test]
    fn traces_are_off_by_default_and_checked_by_name() {
        let defaults = traces("").unwrap().traces;
        assert!(!defaults.enabled());
        assert_eq!(
            (defaults.service_name.as_str(), defaults.sample_ratio),
            ("fleetgate", 1.0)
        );
        let on = traces("otlp_endpoint = \"http://collector:4318\"\nsample_ratio = 0.25").unwrap();
        assert!(on.traces.enabled());
        let refused = |keys: &str| traces(keys).map(|_| ()).unwrap_err().to_string();
        assert!(
            refused("sample_ratio = 1.5").contains("traces.sample_ratio must be between 0 and 1")
        );
        assert!(refused("otlp_endpoint = \"collector:4318\"").contains("traces.otlp_endpoint"));
        assert!(refused("endpoint = \"http://collector:4318\"").contains("endpoint"));
    }
}
