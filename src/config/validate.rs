//! Validation: the rules a loaded config must keep that its types cannot say — values of
//! at least 1, upper bounds, unique model ids, the URL schemes each setting takes,
//! settings that depend on each other. One function per section; every broken rule is
//! said (not only the first), each with the key it is about, so that `config check`
//! can point at its line.

use std::collections::HashSet;

use super::fleet::{FleetSettings, ModelConfig, PREFIX_BLOCK_BYTES};
use super::jobs::{self, JobSettings};
use super::schema::{
    AdminToken, Config, ConnectionSettings, LimitDefaults, RequestLogSettings, TraceSettings,
    WorkbenchSettings,
};
use crate::contract::LOGPROBS_LIMIT;
use crate::key_limits::Limit;
use crate::store::url_scheme;

/// The most of a prompt's start that prefix routing hashes: 64 KiB.
const MAX_PREFIX_BYTES: usize = 64 * 1024;

/// The most prefixes prefix routing may remember per model: 16 Mi (128 MiB).
const MAX_PREFIX_TRACKED: usize = 16 * 1024 * 1024;

/// The longest duration any `*_ms` setting may have: 7 days.
const MAX_DURATION_MS: u64 = 7 * 24 * 3_600_000;

/// More connection threads than this is a typo, not a machine.
const MAX_CONNECTION_THREADS: usize = 1024;

/// The longest request-log retention: 100 years (0 keeps rows forever).
const MAX_RETENTION_DAYS: u32 = 36_500;

/// Words that mark an admin token as a sample to be replaced, compared without case and
/// without `-`, `_`, `.` or spaces: the deploy recipes' `sample-admin-token-change-me`
/// says one of them.
const PLACEHOLDER_WORDS: [&str; 3] = ["changeme", "replaceme", "placeholder"];

/// The schemes `database_url` takes (`store::connect` opens these).
const DATABASE_SCHEMES: [&str; 3] = ["sqlite", "postgres", "postgresql"];

/// The schemes `redis_url` takes: plain TCP, TLS, or a Unix socket.
const REDIS_SCHEMES: [&str; 4] = ["redis", "rediss", "unix", "redis+unix"];

/// A rule the config breaks: the key it is about, dotted with array elements by index
/// (`models.1.upstreams.0.url`, as figment names keys), and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    pub key: String,
    pub message: String,
}

/// The rules broken so far.
#[derive(Default)]
struct Findings(Vec<Broken>);

impl Findings {
    fn broken(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push(Broken {
            key: key.into(),
            message: message.into(),
        });
    }

    /// Says that `key` must be at least 1 when its `value` is 0.
    fn at_least_1(&mut self, key: &str, value: u64) {
        if value == 0 {
            self.broken(key, format!("{key} must be at least 1"));
        }
    }
}

impl Config {
    /// Every rule this config breaks, in the order of the file's sections; none: valid.
    pub(super) fn broken_rules(&self) -> Vec<Broken> {
        let mut found = Findings::default();
        workbench(&self.workbench, &mut found);
        self.top_level(&mut found);
        self.stores(&mut found);
        limits(&self.limits, &mut found);
        models(&self.models, &mut found);
        connections(&self.connections, &mut found);
        fleet(&self.fleet, &mut found);
        jobs(&self.jobs, &mut found);
        request_log(&self.request_log, &mut found);
        self.durations(&mut found);
        traces(&self.traces, &mut found);
        found.0
    }

    /// The keys outside any section.
    fn top_level(&self, found: &mut Findings) {
        found.at_least_1("max_body_bytes", self.max_body_bytes as u64);
        if let Some(admin) = self.admin_listen {
            let taken = [Some(self.listen), self.ops_listen];
            if admin.port() != 0 && taken.contains(&Some(admin)) {
                found.broken(
                    "admin_listen",
                    format!(
                        "admin_listen ({admin}) must be an address of its own, not listen's or ops_listen's"
                    ),
                );
            }
        }
        match &self.admin_token {
            Some(token) if token.expose().len() < 16 => {
                found.broken("admin_token", "admin_token must be at least 16 characters");
            }
            Some(token) if is_placeholder(token) => found.broken(
                "admin_token",
                "admin_token is a sample value (it says change-me or the like): replace it with a secret of your own, e.g. the output of `openssl rand -hex 32`, or leave it unset to turn the admin API off",
            ),
            _ => {}
        }
    }

    /// The stores' URL schemes, checked here so that a wrong one stops the start before
    /// anything is opened (a database migrated, then a Redis URL refused). Only the
    /// scheme is said back: the rest of the URL may hold a password.
    fn stores(&self, found: &mut Findings) {
        if !url_scheme(&self.database_url).is_some_and(|s| DATABASE_SCHEMES.contains(&s)) {
            found.broken(
                "database_url",
                format!(
                    "database_url must be a sqlite: or postgres: URL, e.g. sqlite://data/fleetgate.db or postgres://user@host/db (got {})",
                    said_scheme(&self.database_url)
                ),
            );
        }
        if let Some(url) = &self.redis_url
            && !url_scheme(url).is_some_and(|s| REDIS_SCHEMES.contains(&s))
        {
            found.broken(
                "redis_url",
                format!(
                    "redis_url must start with redis://, rediss:// (TLS), unix:// or redis+unix:// (got {})",
                    said_scheme(url)
                ),
            );
        }
    }

    /// Every `*_ms` setting, of whichever section, is at most [`MAX_DURATION_MS`].
    fn durations(&self, found: &mut Findings) {
        let connections = &self.connections;
        let fleet = &self.fleet;
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
        .chain(self.jobs.durations())
        .map(|(key, ms)| (key.to_owned(), key.to_owned(), ms));
        let model_durations = self.models.iter().enumerate().flat_map(|(i, model)| {
            [
                ("boot_timeout_ms", model.boot_timeout_ms),
                ("keep_warm_ms", model.keep_warm_ms),
                ("idle_sleep_ms", model.idle_sleep_ms),
            ]
            .map(|(key, ms)| {
                let name = format!("models.{key} of '{}'", model.id);
                (format!("models.{i}.{key}"), name, ms)
            })
        });
        for (key, name, ms) in durations.chain(model_durations) {
            if ms > MAX_DURATION_MS {
                let message =
                    format!("{name} must be at most {MAX_DURATION_MS} (7 days; got {ms})");
                found.broken(key, message);
            }
        }
    }
}

/// What a refused URL is said as: its scheme only, or that it has none.
fn said_scheme(url: &str) -> String {
    match url_scheme(url) {
        Some(scheme) => format!("a {scheme}: URL"),
        None => "no scheme".to_owned(),
    }
}

/// Whether `token` is one of the samples that recipes and examples ship (see
/// [`PLACEHOLDER_WORDS`]): anybody who has read them would hold the admin API.
fn is_placeholder(token: &AdminToken) -> bool {
    let folded: String = token
        .expose()
        .chars()
        .filter(|c| !matches!(c, '-' | '_' | ' ' | '.'))
        .flat_map(char::to_lowercase)
        .collect();
    PLACEHOLDER_WORDS.iter().any(|word| folded.contains(word))
}

fn request_log(request_log: &RequestLogSettings, found: &mut Findings) {
    if request_log.retention_days > MAX_RETENTION_DAYS {
        found.broken(
            "request_log.retention_days",
            format!(
                "request_log.retention_days must be at most {MAX_RETENTION_DAYS} (got {}; 0 keeps rows forever)",
                request_log.retention_days
            ),
        );
    }
}

fn workbench(workbench: &WorkbenchSettings, found: &mut Findings) {
    found.at_least_1(
        "workbench.checkpoint_sweep_secs",
        workbench.checkpoint_sweep_secs,
    );
    if i64::try_from(workbench.checkpoint_ttl_secs).is_err() {
        found.broken(
            "workbench.checkpoint_ttl_secs",
            "workbench.checkpoint_ttl_secs is too large",
        );
    }
    if workbench.max_bytes_per_key == 0 || i64::try_from(workbench.max_bytes_per_key).is_err() {
        found.broken(
            "workbench.max_bytes_per_key",
            format!(
                "workbench.max_bytes_per_key must be from 1 to {} (got {})",
                i64::MAX,
                workbench.max_bytes_per_key
            ),
        );
    }
    found.at_least_1(
        "workbench.max_import_nodes",
        workbench.max_import_nodes.into(),
    );
}

fn limits(limits: &LimitDefaults, found: &mut Findings) {
    found.at_least_1(
        "limits.requests_per_minute",
        limits.requests_per_minute.into(),
    );
    found.at_least_1("limits.max_concurrent", limits.max_concurrent.into());
    // A key's own share is held to the same bounds (the key service's check).
    if let Err(err) = Limit::Share.check::<u32>(limits.share) {
        found.broken("limits.share", format!("limits.{err}"));
    }
}

/// `[[models]]`: at least one, ids unique, exactly one default, and each model's own
/// settings and nodes.
fn models(models: &[ModelConfig], found: &mut Findings) {
    if models.is_empty() {
        found.broken("models", "at least one [[models]] entry is required");
    }
    let mut ids = HashSet::new();
    for (i, model) in models.iter().enumerate() {
        if model.id.is_empty() {
            found.broken(format!("models.{i}.id"), "models.id must not be empty");
        } else if !ids.insert(model.id.as_str()) {
            found.broken(
                format!("models.{i}.id"),
                format!("models.id '{}' appears twice", model.id),
            );
        }
        model_settings(i, model, found);
    }
    let defaults = models.iter().filter(|m| m.default).count();
    // A single model is the default whether or not it says so.
    if defaults != 1 && !(defaults <= 1 && models.len() <= 1) {
        found.broken(
            "models",
            format!("exactly one model must have default = true (found {defaults})"),
        );
    }
}

/// The `i`th model's settings and nodes.
fn model_settings(i: usize, model: &ModelConfig, found: &mut Findings) {
    let id = &model.id;
    if model.max_logprobs > LOGPROBS_LIMIT {
        found.broken(
            format!("models.{i}.max_logprobs"),
            format!(
                "models.max_logprobs of '{id}' must be at most {LOGPROBS_LIMIT} (got {})",
                model.max_logprobs
            ),
        );
    }
    if model.upstreams.is_empty() {
        found.broken(
            format!("models.{i}.upstreams"),
            format!("model '{id}' needs at least one [[models.upstreams]] entry"),
        );
    }
    if !(model.decode_tokens_per_second.is_finite() && model.decode_tokens_per_second > 0.0) {
        found.broken(
            format!("models.{i}.decode_tokens_per_second"),
            format!("models.decode_tokens_per_second of '{id}' must be above 0"),
        );
    }
    if model.sleep_url.is_some() && model.wake_url.is_none() {
        found.broken(
            format!("models.{i}.sleep_url"),
            format!("model '{id}' has a sleep_url but no wake_url to wake it again"),
        );
    }
    for (key, hook) in [
        ("wake_url", &model.wake_url),
        ("sleep_url", &model.sleep_url),
    ] {
        if let Some(hook) = hook
            && !is_http_url(hook)
        {
            found.broken(
                format!("models.{i}.{key}"),
                format!("models.{key} of '{id}' must be an http(s) URL (got '{hook}')"),
            );
        }
    }
    for (j, upstream) in model.upstreams.iter().enumerate() {
        let key = |name: &str| format!("models.{i}.upstreams.{j}.{name}");
        if upstream.max_in_flight == Some(0) {
            found.broken(
                key("max_in_flight"),
                format!("models.upstreams.max_in_flight of '{id}' must be at least 1"),
            );
        }
        if upstream.weight == 0 {
            found.broken(
                key("weight"),
                format!("models.upstreams.weight of '{id}' must be at least 1"),
            );
        }
        if !is_http_url(&upstream.url) {
            found.broken(
                key("url"),
                format!(
                    "models.upstreams.url of '{id}' must be an http(s) URL (got '{}')",
                    upstream.url
                ),
            );
        }
    }
}

fn connections(connections: &ConnectionSettings, found: &mut Findings) {
    for (key, value) in [
        ("connections.max_open", connections.max_open as u64),
        ("connections.ops_max_open", connections.ops_max_open as u64),
        (
            "connections.header_read_timeout_ms",
            connections.header_read_timeout_ms,
        ),
        (
            "connections.body_read_timeout_ms",
            connections.body_read_timeout_ms,
        ),
        (
            "connections.reading_bytes_per_key",
            connections.reading_bytes_per_key as u64,
        ),
    ] {
        found.at_least_1(key, value);
    }
    if connections.max_open_per_client > connections.max_open {
        found.broken(
            "connections.max_open_per_client",
            format!(
                "connections.max_open_per_client must be at most connections.max_open ({}; 0 turns it off), got {}",
                connections.max_open, connections.max_open_per_client
            ),
        );
    }
    if connections.threads > MAX_CONNECTION_THREADS {
        found.broken(
            "connections.threads",
            format!(
                "connections.threads must be at most {MAX_CONNECTION_THREADS} (got {}; 0 serves connections on the shared worker threads)",
                connections.threads
            ),
        );
    }
}

fn fleet(fleet: &FleetSettings, found: &mut Findings) {
    for (key, value) in [
        ("fleet.probe_interval_ms", fleet.probe_interval_ms),
        ("fleet.probe_timeout_ms", fleet.probe_timeout_ms),
        ("fleet.eject_base_ms", fleet.eject_base_ms),
        ("fleet.request_window_ms", fleet.request_window_ms),
        ("fleet.keepalive_interval_ms", fleet.keepalive_interval_ms),
    ] {
        found.at_least_1(key, value);
    }
    if fleet.eject_max_ms < fleet.eject_base_ms {
        found.broken(
            "fleet.eject_max_ms",
            "fleet.eject_max_ms must be at least fleet.eject_base_ms",
        );
    }
    if !(PREFIX_BLOCK_BYTES..=MAX_PREFIX_BYTES).contains(&fleet.prefix_bytes) {
        found.broken(
            "fleet.prefix_bytes",
            format!(
                "fleet.prefix_bytes must be between {PREFIX_BLOCK_BYTES} and {MAX_PREFIX_BYTES} (got {})",
                fleet.prefix_bytes
            ),
        );
    }
    if !(1..=MAX_PREFIX_TRACKED).contains(&fleet.prefix_tracked) {
        found.broken(
            "fleet.prefix_tracked",
            format!(
                "fleet.prefix_tracked must be between 1 and {MAX_PREFIX_TRACKED} (got {})",
                fleet.prefix_tracked
            ),
        );
    }
    if !(fleet.prefix_imbalance_abs.is_finite() && fleet.prefix_imbalance_abs >= 0.0) {
        found.broken(
            "fleet.prefix_imbalance_abs",
            format!(
                "fleet.prefix_imbalance_abs must be 0 or more (got {})",
                fleet.prefix_imbalance_abs
            ),
        );
    }
    if !(fleet.prefix_imbalance_rel.is_finite() && fleet.prefix_imbalance_rel >= 1.0) {
        found.broken(
            "fleet.prefix_imbalance_rel",
            format!(
                "fleet.prefix_imbalance_rel must be at least 1 (got {})",
                fleet.prefix_imbalance_rel
            ),
        );
    }
}

fn jobs(jobs: &JobSettings, found: &mut Findings) {
    if jobs.lease_ms < 300 {
        found.broken("jobs.lease_ms", "jobs.lease_ms must be at least 300");
    }
    found.at_least_1("jobs.poll_interval_ms", jobs.poll_interval_ms);
    found.at_least_1("jobs.sweep_interval_ms", jobs.sweep_interval_ms);
    if jobs.max_waiters > jobs::MAX_WAITERS {
        found.broken(
            "jobs.max_waiters",
            format!(
                "jobs.max_waiters must be at most {} (got {})",
                jobs::MAX_WAITERS,
                jobs.max_waiters
            ),
        );
    }
    found.at_least_1("jobs.max_attempts", jobs.max_attempts.into());
    found.at_least_1("jobs.run_timeout_ms", jobs.run_timeout_ms);
    found.at_least_1(
        "jobs.max_pending_bytes_per_key",
        jobs.max_pending_bytes_per_key,
    );
}

fn traces(traces: &TraceSettings, found: &mut Findings) {
    if !(0.0..=1.0).contains(&traces.sample_ratio) {
        found.broken(
            "traces.sample_ratio",
            format!(
                "traces.sample_ratio must be between 0 and 1 (got {})",
                traces.sample_ratio
            ),
        );
    }
    if let Some(endpoint) = traces.otlp_endpoint.as_deref()
        && !is_http_url(endpoint)
    {
        found.broken(
            "traces.otlp_endpoint",
            format!("traces.otlp_endpoint must be an http(s) URL (got '{endpoint}')"),
        );
    }
}

fn is_http_url(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
}

#[cfg(test)]
mod tests {
    use super::Broken;
    use crate::config::Config;
    use crate::config::schema::tests::{document, parse};

    impl Config {
        /// The broken rules, said as one line.
        fn validate(&self) -> Result<(), String> {
            let broken = self.broken_rules();
            if broken.is_empty() {
                return Ok(());
            }
            let said: Vec<String> = broken.into_iter().map(|b| b.message).collect();
            Err(said.join("; "))
        }
    }

    /// Why a config with `keys` under `[section]` is refused.
    fn refusal(section: &str, keys: &str) -> String {
        parse(&document(section, keys, ""))
            .unwrap()
            .validate()
            .unwrap_err()
    }

    #[test]
    fn prefix_settings_out_of_range_are_refused_by_name() {
        let refused = |keys| refusal("fleet", keys);
        assert!(refused("prefix_bytes = 100").contains("fleet.prefix_bytes must be between 256"));
        assert!(refused("prefix_imbalance_abs = -1").contains("fleet.prefix_imbalance_abs"));
        assert!(refused("prefix_imbalance_rel = 0.5").contains("fleet.prefix_imbalance_rel"));
        assert!(refused("prefix_tracked = 0").contains("fleet.prefix_tracked must be between 1"));
        let keys = "prefix_imbalance_abs = 0\nprefix_imbalance_rel = 1";
        assert!(
            parse(&document("fleet", keys, ""))
                .unwrap()
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn connection_threads_are_bounded() {
        let refused = refusal("connections", "threads = 100000");
        assert!(
            refused.contains("connections.threads must be at most 1024 (got 100000"),
            "{refused}"
        );
    }

    #[test]
    fn placeholder_admin_tokens_are_refused_saying_how_to_make_one() {
        let refused = |token: &str| {
            parse(&format!(
                "admin_token = \"{token}\"\n{}",
                document("limits", "", "")
            ))
            .unwrap()
            .validate()
        };
        for token in [
            "sample-admin-token-change-me",
            "prod-ChAnGe_Me-0123456789",
            "changeme-changeme-changeme",
            "replace-me-with-a-real-token",
            "PLACEHOLDER-0123456789abcdef",
        ] {
            let refusal = refused(token).unwrap_err();
            assert!(
                refusal.contains("openssl rand -hex 32"),
                "{token}: {refusal}"
            );
            assert!(!refusal.contains(token), "{refusal}");
        }
        assert!(refused("3f9c2a7e1b4d6058a9e7c3b1d2f4a6e8").is_ok());
    }

    #[test]
    fn the_admin_listener_needs_an_address_of_its_own() {
        let refused = |top: &str| {
            parse(&format!("{top}\n{}", document("limits", "", "")))
                .unwrap()
                .validate()
        };
        let taken = refused("listen = \"127.0.0.1:8080\"\nadmin_listen = \"127.0.0.1:8080\"");
        assert!(
            taken
                .unwrap_err()
                .contains("admin_listen (127.0.0.1:8080) must be an address of its own"),
        );
        assert!(
            refused("ops_listen = \"127.0.0.1:9090\"\nadmin_listen = \"127.0.0.1:9090\"").is_err()
        );
        assert!(refused("admin_listen = \"127.0.0.1:8090\"").is_ok());
    }

    #[test]
    fn the_default_share_is_1_and_bounded_as_a_keys_own() {
        let share = |keys| parse(&document("limits", keys, "")).unwrap().limits.share;
        assert_eq!((share(""), share("share = 1000")), (1, 1000));
        assert!(
            parse(&document("limits", "share = 1000", ""))
                .unwrap()
                .validate()
                .is_ok()
        );
        for (keys, got) in [("share = 0", 0), ("share = 1001", 1001)] {
            let refused = refusal("limits", keys);
            assert!(
                refused.contains(&format!(
                    "limits.share must be between 1 and 1000 (got {got})"
                )),
                "{refused}"
            );
        }
    }

    #[test]
    fn request_log_retention_is_bounded() {
        let refused = refusal("request_log", "retention_days = 40000");
        assert!(
            refused.contains("request_log.retention_days must be at most 36500"),
            "{refused}"
        );
        let kept = |keys| {
            parse(&document("request_log", keys, ""))
                .unwrap()
                .request_log
                .retention_days
        };
        assert_eq!((kept(""), kept("retention_days = 0")), (90, 0));
    }

    #[test]
    fn connection_caps_are_checked_by_name() {
        let refused = |keys| refusal("connections", keys);
        assert!(refused("ops_max_open = 0").contains("ops_max_open"));
        let over = refused("max_open = 10\nmax_open_per_client = 11");
        assert!(
            over.contains(
                "connections.max_open_per_client must be at most connections.max_open (10"
            ),
            "{over}"
        );
    }

    #[test]
    fn traces_are_checked_by_name() {
        let refused = |keys| refusal("traces", keys);
        assert!(
            refused("sample_ratio = 1.5").contains("traces.sample_ratio must be between 0 and 1")
        );
        assert!(refused("otlp_endpoint = \"collector:4318\"").contains("traces.otlp_endpoint"));
    }

    #[test]
    fn every_broken_rule_is_said_with_its_key() {
        let document = format!(
            "database_url = \"mysql://u:secret@db/x\"\nredis_url = \"http://cache:6379\"\n{}",
            document(
                "fleet",
                "prefix_bytes = 100\neject_max_ms = 0",
                "max_logprobs = 100000"
            )
        );
        let broken = parse(&document).unwrap().broken_rules();
        let keys: Vec<&str> = broken.iter().map(|b| b.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "database_url",
                "redis_url",
                "models.0.max_logprobs",
                "fleet.eject_max_ms",
                "fleet.prefix_bytes"
            ],
            "{broken:?}"
        );
        let said = |key: &str| {
            broken
                .iter()
                .find(|b: &&Broken| b.key == key)
                .map(|b| b.message.clone())
                .unwrap()
        };
        assert!(said("database_url").contains("(got a mysql: URL)"));
        assert!(!said("database_url").contains("secret"));
        assert!(said("redis_url").contains("rediss:// (TLS)"));
    }

    #[test]
    fn each_store_scheme_is_taken() {
        for (key, url) in [
            ("database_url", "sqlite://data/fg.db"),
            ("database_url", "sqlite::memory:"),
            ("database_url", "postgres://fg@db/x"),
            ("database_url", "postgresql://db/x"),
            ("redis_url", "redis://cache:6379/0"),
            ("redis_url", "rediss://cache:6380"),
            ("redis_url", "unix:///run/redis.sock"),
            ("redis_url", "redis+unix:///run/redis.sock"),
        ] {
            let document = format!("{key} = \"{url}\"\n{}", document("limits", "", ""));
            assert!(parse(&document).unwrap().validate().is_ok(), "{url}");
        }
        let document = format!(
            "database_url = \"data/fg.db\"\n{}",
            document("limits", "", "")
        );
        let refused = parse(&document).unwrap().validate().unwrap_err();
        assert!(refused.contains("(got no scheme)"), "{refused}");
    }
}
