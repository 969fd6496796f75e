//! The configuration's schema: the settings as serde reads them, each with its default,
//! and unknown keys refused. The top level and its small sections are here; `[fleet]`
//! with `[[models]]` and `[jobs]` have files of their own (`fleet.rs`, `jobs.rs`). What
//! serde cannot check (bounds, rules across settings) is `validate.rs`'s.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::fleet::{FleetSettings, ModelConfig};
use super::jobs::JobSettings;

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
    /// Serves the admin API (`/admin/…`) on this address instead of `listen`, e.g. on a
    /// private interface: a leaked or guessed admin token is then of no use from where
    /// the clients are. Unset: on `listen`, beside the API.
    #[serde(default)]
    pub admin_listen: Option<SocketAddr>,
    /// HTTPS on `listen`: the certificate and key files (`https_certificate.rs`).
    /// Unset: plain HTTP. `ops_listen` and `admin_listen` stay plain HTTP either way.
    #[serde(default)]
    pub tls: Option<TlsSettings>,
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
    /// TLS to Redis (a `rediss://` URL): extra trusted roots, a client certificate,
    /// the certificate's name.
    #[serde(default)]
    pub redis_tls: RedisTlsSettings,
    /// Bearer token for the `/admin` API; without it the admin API is off (404).
    #[serde(default)]
    pub admin_token: Option<AdminToken>,
    /// OpenTelemetry traces, exported over OTLP; off unless `otlp_endpoint` is set.
    #[serde(default)]
    pub traces: TraceSettings,
    /// The Workbench and Loom: how long their recovery checkpoints are kept, and what
    /// one key may keep there.
    #[serde(default)]
    pub workbench: WorkbenchSettings,
    /// Completion jobs: workers, long-polls, retention.
    #[serde(default)]
    pub jobs: JobSettings,
    /// The request log's retention.
    #[serde(default)]
    pub request_log: RequestLogSettings,
    pub models: Vec<ModelConfig>,
    /// The file this was loaded from, which a reload reads again (`reload.rs`); `None`
    /// for a config built from a string.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

impl Config {
    /// Index of the default model (validated to exist).
    pub fn default_model_index(&self) -> usize {
        self.models.iter().position(|m| m.default).unwrap_or(0)
    }
}

/// `[tls]`: the files of the certificate `listen` serves over HTTPS. Read at start-up
/// and again on every reload (SIGHUP or `POST /admin/reload`); a relative path is
/// relative to the config file's directory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM: the server's certificate first, then the intermediates that chain it to
    /// the root the clients trust.
    pub cert_file: PathBuf,
    /// PEM: the certificate's private key (PKCS#8, PKCS#1 RSA or SEC1 EC).
    pub key_file: PathBuf,
}

/// TLS to Redis (`redis_tls`), for every Redis connection of a `rediss://` URL. The
/// server's certificate is checked against the platform's roots (and `SSL_CERT_FILE`)
/// plus `ca_file`. Relative paths are relative to the config file's directory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisTlsSettings {
    /// PEM file of CA certificates to trust besides the platform's (a private CA).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate (chain) for mutual TLS; needs `key_file`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM file of the client certificate's private key.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must carry, when it is not the URL's host
    /// (connecting by IP address, or through a tunnel).
    #[serde(default)]
    pub server_name: Option<String>,
}

impl RedisTlsSettings {
    /// Whether any setting is given.
    pub fn is_set(&self) -> bool {
        *self != Self::default()
    }

    /// The files' paths made relative to `dir` (the config file's directory).
    pub(super) fn relative_to(&mut self, dir: &std::path::Path) {
        for file in [&mut self.ca_file, &mut self.cert_file, &mut self.key_file]
            .into_iter()
            .flatten()
        {
            *file = dir.join(&*file);
        }
    }
}

/// The Workbench and Loom (`http::routes::workbench`). Saved prompts, runs and trees stay until
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
    /// Bytes one key may keep: its items' titles and contents (recovery checkpoints
    /// included until swept), its trees' titles and its nodes' texts and metas, and
    /// `store::workbench::ROW_BYTES` a row. A write
    /// that would go over is refused whole with 413 `storage_quota_exceeded`.
    #[serde(default = "default_max_bytes_per_key")]
    pub max_bytes_per_key: u64,
    /// Nodes one tree import may hold; more is 413 `request_too_large`.
    #[serde(default = "default_max_import_nodes")]
    pub max_import_nodes: u32,
}

impl Default for WorkbenchSettings {
    fn default() -> Self {
        Self {
            checkpoint_ttl_secs: default_checkpoint_ttl_secs(),
            checkpoint_sweep_secs: default_checkpoint_sweep_secs(),
            max_bytes_per_key: default_max_bytes_per_key(),
            max_import_nodes: default_max_import_nodes(),
        }
    }
}

/// The request log (`request_log`, `background::request_log_retention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestLogSettings {
    /// Days a request's metadata row is kept; older rows are deleted by an hourly
    /// sweep. 0 keeps them forever.
    #[serde(default = "default_retention_days")]
    pub retention_days: u32,
}

impl Default for RequestLogSettings {
    fn default() -> Self {
        Self {
            retention_days: default_retention_days(),
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
    /// Share of new traces kept, 0 to 1. An authenticated request (a valid key or the
    /// admin token) that arrives with a `traceparent` follows its sampled flag instead
    /// (parent-based sampling), so a trace is kept or dropped whole across client,
    /// gateway and vLLM; an unauthenticated one starts a trace of its own, kept at this
    /// ratio like any other.
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
    /// A key's weight in its models' fleet queues (1 to 1000): while a model's nodes are
    /// all busy, keys with work waiting get node slots in proportion to their share,
    /// counted in tokens.
    #[serde(default = "default_share")]
    pub share: u32,
}

impl Default for LimitDefaults {
    fn default() -> Self {
        Self {
            enabled: true,
            monthly_budget: default_monthly_budget(),
            requests_per_minute: default_rpm(),
            max_concurrent: default_max_concurrent(),
            max_queued: default_max_queued(),
            share: default_share(),
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
    /// The same for the ops listener (`ops_listen`), counted apart: connections held
    /// open there cannot take the API's, nor the API's a probe's.
    #[serde(default = "default_ops_max_open_connections")]
    pub ops_max_open: usize,
    /// Connections open at once from one peer address, on each listener; one beyond is
    /// closed as soon as it is accepted. `0` (the default): no such cap. Behind a load
    /// balancer or proxy every client has its address: leave it off there, or set it
    /// above what the proxy opens.
    #[serde(default)]
    pub max_open_per_client: usize,
    /// A request's head (start line and headers) must have arrived this long after the
    /// connection opened or its previous response ended, else the connection is closed;
    /// so this is also how long an idle keep-alive connection is kept (HTTP/1), how long
    /// an HTTP/2 connection is kept with no request under way, and how long an HTTP/2
    /// client may stay silent before it is pinged and then take to answer the ping.
    #[serde(default = "default_header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// A request's body must have arrived this long after its head was read, else
    /// 408 `request_timeout` (on every route that reads a body).
    #[serde(default = "default_body_read_timeout_ms")]
    pub body_read_timeout_ms: u64,
    /// Bytes one key's request bodies may hold while they are read, all its
    /// connections together (a body counts its `Content-Length`, or its route's limit
    /// when it declares none; one body alone always goes through). Beyond: 429
    /// `queue_full`, before any of the body is read.
    #[serde(default = "default_reading_bytes_per_key")]
    pub reading_bytes_per_key: usize,
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
            ops_max_open: default_ops_max_open_connections(),
            max_open_per_client: 0,
            header_read_timeout_ms: default_header_read_timeout_ms(),
            body_read_timeout_ms: default_body_read_timeout_ms(),
            reading_bytes_per_key: default_reading_bytes_per_key(),
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
fn default_shutdown_grace_ms() -> u64 {
    30_000
}
fn default_max_open_connections() -> usize {
    10_000
}
/// A scraper and a few probes need a handful; this leaves room for many of them.
fn default_ops_max_open_connections() -> usize {
    100
}
fn default_header_read_timeout_ms() -> u64 {
    60_000
}
fn default_body_read_timeout_ms() -> u64 {
    120_000
}
/// 128 MiB: four bodies at the default `max_body_bytes`, or a hundred uploads of a
/// long prompt at once.
fn default_reading_bytes_per_key() -> usize {
    128 * 1024 * 1024
}
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
fn default_share() -> u32 {
    1
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
fn default_retention_days() -> u32 {
    90
}
/// 256 MiB: about 2,500 saved runs with full per-token logprobs (~100 kB each), or a
/// thousand trees of a few hundred nodes, while 1,000 keys at their bound still fit a
/// 256 GB disk.
fn default_max_bytes_per_key() -> u64 {
    256 << 20
}
/// 10,000: far more than a tree grown by hand in the page, few enough that an import is
/// 20 batches of the store's writer.
fn default_max_import_nodes() -> u32 {
    10_000
}
fn default_service_name() -> String {
    "fleetgate".to_owned()
}
fn default_sample_ratio() -> f64 {
    1.0
}

/// Also the config documents of `load.rs`'s and `validate.rs`'s tests.
#[cfg(test)]
pub(super) mod tests {
    use figment::Figment;
    use figment::providers::{Format, Toml};

    use super::*;
    use crate::config::fleet::{Hold, Routing};

    /// A config document with one model: `keys` under `[section]`, `model_keys` in the
    /// model.
    pub fn document(section: &str, keys: &str, model_keys: &str) -> String {
        format!(
            "[{section}]\n{keys}\n[[models]]\nid = \"m\"\n{model_keys}\n[[models.upstreams]]\nurl = \"http://127.0.0.1:1\"\ngpu = \"g\"\n"
        )
    }

    /// `document` read into the schema alone: no environment, no validation.
    pub fn parse(document: &str) -> Result<Config, String> {
        Figment::from(Toml::string(document))
            .extract()
            .map_err(|e| e.to_string())
    }

    #[test]
    fn routing_is_set_fleet_wide_and_overridden_per_model() {
        let config = parse(&document(
            "fleet",
            "routing = \"load\"",
            "routing = \"prefix\"",
        ))
        .unwrap();
        assert_eq!(config.fleet.routing, Routing::Load);
        assert_eq!(config.models[0].routing, Some(Routing::Prefix));
        let defaults = parse(&document("fleet", "", "")).unwrap();
        assert_eq!(
            (defaults.fleet.routing, defaults.models[0].routing),
            (Routing::Prefix, None)
        );
        let refused = parse(&document("fleet", "routing = \"random\"", ""))
            .map(|_| ())
            .unwrap_err();
        assert!(refused.contains("random"), "{refused}");
    }

    #[test]
    fn hold_is_auto_unless_turned_off() {
        let hold = |keys| parse(&document("fleet", keys, "")).map(|c| c.fleet.hold);
        assert_eq!(hold(""), Ok(Hold::Auto));
        assert_eq!(hold("hold = \"off\""), Ok(Hold::Off));
        let refused = hold("hold = \"sometimes\"").unwrap_err();
        assert!(refused.contains("sometimes"), "{refused}");
    }

    #[test]
    fn connection_threads_default_to_one_per_cpu() {
        let threads = |keys| {
            parse(&document("connections", keys, ""))
                .unwrap()
                .connections
                .threads
        };
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        assert_eq!(threads(""), cpus);
        assert_eq!(threads("threads = 0"), 0);
    }

    #[test]
    fn traces_are_off_by_default() {
        let defaults = parse(&document("traces", "", "")).unwrap().traces;
        assert!(!defaults.enabled());
        assert_eq!(
            (defaults.service_name.as_str(), defaults.sample_ratio),
            ("fleetgate", 1.0)
        );
        let keys = "otlp_endpoint = \"http://collector:4318\"\nsample_ratio = 0.25";
        assert!(
            parse(&document("traces", keys, ""))
                .unwrap()
                .traces
                .enabled()
        );
    }
}
