//! Validation: the rules a loaded config must keep that its types cannot say — values of
//! at least 1, upper bounds, unique model ids, http(s) URLs, settings that depend on
//! each other. One function per section; the first broken rule is the error, naming
//! the key it is about.

use std::collections::HashSet;

use super::fleet::{FleetSettings, ModelConfig, PREFIX_BLOCK_BYTES};
use super::jobs::{self, JobSettings};
use super::schema::{
    AdminToken, Config, ConnectionSettings, LimitDefaults, RequestLogSettings, TraceSettings,
    WorkbenchSettings,
};
use crate::contract::LOGPROBS_LIMIT;
use crate::key_limits::Limit;

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

impl Config {
    /// The first rule this config breaks, said as the error.
    pub(super) fn validate(&self) -> Result<(), String> {
        workbench(&self.workbench)?;
        self.top_level()?;
        limits(&self.limits)?;
        models(&self.models)?;
        connections(&self.connections)?;
        fleet(&self.fleet)?;
        jobs(&self.jobs)?;
        request_log(&self.request_log)?;
        self.durations()?;
        traces(&self.traces)
    }

    /// The keys outside any section.
    fn top_level(&self) -> Result<(), String> {
        if self.max_body_bytes == 0 {
            return Err("max_body_bytes must be at least 1".into());
        }
        if let Some(admin) = self.admin_listen {
            let taken = [Some(self.listen), self.ops_listen];
            if admin.port() != 0 && taken.contains(&Some(admin)) {
                return Err(format!(
                    "admin_listen ({admin}) must be an address of its own, not listen's or ops_listen's"
                ));
            }
        }
        match &self.admin_token {
            Some(token) if token.expose().len() < 16 => {
                Err("admin_token must be at least 16 characters".into())
            }
            Some(token) if is_placeholder(token) => Err(
                "admin_token is a sample value (it says change-me or the like): replace it with a secret of your own, e.g. the output of `openssl rand -hex 32`, or leave it unset to turn the admin API off".into(),
            ),
            _ => Ok(()),
        }
    }

    /// Every `*_ms` setting, of whichever section, is at most [`MAX_DURATION_MS`].
    fn durations(&self) -> Result<(), String> {
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
                return Err(format!(
                    "{name} must be at most {MAX_DURATION_MS} (7 days; got {ms})"
                ));
            }
        }
        Ok(())
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

fn request_log(request_log: &RequestLogSettings) -> Result<(), String> {
    if request_log.retention_days > MAX_RETENTION_DAYS {
        return Err(format!(
            "request_log.retention_days must be at most {MAX_RETENTION_DAYS} (got {}; 0 keeps rows forever)",
            request_log.retention_days
        ));
    }
    Ok(())
}

fn workbench(workbench: &WorkbenchSettings) -> Result<(), String> {
    if workbench.checkpoint_sweep_secs == 0 {
        return Err("workbench.checkpoint_sweep_secs must be at least 1".into());
    }
    if i64::try_from(workbench.checkpoint_ttl_secs).is_err() {
        return Err("workbench.checkpoint_ttl_secs is too large".into());
    }
    if workbench.max_bytes_per_key == 0 || i64::try_from(workbench.max_bytes_per_key).is_err() {
        return Err(format!(
            "workbench.max_bytes_per_key must be from 1 to {} (got {})",
            i64::MAX,
            workbench.max_bytes_per_key
        ));
    }
    if workbench.max_import_nodes == 0 {
        return Err("workbench.max_import_nodes must be at least 1".into());
    }
    Ok(())
}

fn limits(limits: &LimitDefaults) -> Result<(), String> {
    if limits.requests_per_minute == 0 || limits.max_concurrent == 0 {
        return Err(
            "limits.requests_per_minute and limits.max_concurrent must be at least 1".into(),
        );
    }
    // A key's own share is held to the same bounds (the key service's check).
    Limit::Share
        .check::<u32>(limits.share)
        .map_err(|err| format!("limits.{err}"))?;
    Ok(())
}

/// `[[models]]`: at least one, ids unique, exactly one default, and each model's own
/// settings and nodes.
fn models(models: &[ModelConfig]) -> Result<(), String> {
    if models.is_empty() {
        return Err("at least one [[models]] entry is required".into());
    }
    let mut ids = HashSet::new();
    for model in models {
        if model.id.is_empty() {
            return Err("models.id must not be empty".into());
        }
        if !ids.insert(model.id.as_str()) {
            return Err(format!("models.id '{}' appears twice", model.id));
        }
        model_settings(model)?;
    }
    let defaults = models.iter().filter(|m| m.default).count();
    // A single model is the default whether or not it says so.
    if defaults != 1 && !(defaults == 0 && models.len() == 1) {
        return Err(format!(
            "exactly one model must have default = true (found {defaults})"
        ));
    }
    Ok(())
}

/// One model's settings and nodes.
fn model_settings(model: &ModelConfig) -> Result<(), String> {
    if model.max_logprobs > LOGPROBS_LIMIT {
        return Err(format!(
            "models.max_logprobs of '{}' must be at most {LOGPROBS_LIMIT} (got {})",
            model.id, model.max_logprobs
        ));
    }
    if model.upstreams.is_empty() {
        return Err(format!(
            "model '{}' needs at least one [[models.upstreams]] entry",
            model.id
        ));
    }
    if !(model.decode_tokens_per_second.is_finite() && model.decode_tokens_per_second > 0.0) {
        return Err(format!(
            "models.decode_tokens_per_second of '{}' must be above 0",
            model.id
        ));
    }
    if model.sleep_url.is_some() && model.wake_url.is_none() {
        return Err(format!(
            "model '{}' has a sleep_url but no wake_url to wake it again",
            model.id
        ));
    }
    for hook in [&model.wake_url, &model.sleep_url].into_iter().flatten() {
        if !is_http_url(hook) {
            return Err(format!(
                "models.wake_url/sleep_url of '{}' must be an http(s) URL (got '{hook}')",
                model.id
            ));
        }
    }
    for upstream in &model.upstreams {
        if upstream.max_in_flight == Some(0) {
            return Err(format!(
                "models.upstreams.max_in_flight of '{}' must be at least 1",
                model.id
            ));
        }
        if upstream.weight == 0 {
            return Err(format!(
                "models.upstreams.weight of '{}' must be at least 1",
                model.id
            ));
        }
        if !is_http_url(&upstream.url) {
            return Err(format!(
                "models.upstreams.url of '{}' must be an http(s) URL (got '{}')",
                model.id, upstream.url
            ));
        }
    }
    Ok(())
}

fn connections(connections: &ConnectionSettings) -> Result<(), String> {
    if connections.max_open == 0
        || connections.ops_max_open == 0
        || connections.header_read_timeout_ms == 0
        || connections.body_read_timeout_ms == 0
        || connections.reading_bytes_per_key == 0
    {
        return Err(
            "connections.max_open, ops_max_open, header_read_timeout_ms, body_read_timeout_ms and reading_bytes_per_key must be at least 1".into(),
        );
    }
    if connections.max_open_per_client > connections.max_open {
        return Err(format!(
            "connections.max_open_per_client must be at most connections.max_open ({}; 0 turns it off), got {}",
            connections.max_open, connections.max_open_per_client
        ));
    }
    if connections.threads > MAX_CONNECTION_THREADS {
        return Err(format!(
            "connections.threads must be at most {MAX_CONNECTION_THREADS} (got {}; 0 serves connections on the shared worker threads)",
            connections.threads
        ));
    }
    Ok(())
}

fn fleet(fleet: &FleetSettings) -> Result<(), String> {
    if fleet.probe_interval_ms == 0
        || fleet.probe_timeout_ms == 0
        || fleet.eject_base_ms == 0
        || fleet.request_window_ms == 0
        || fleet.keepalive_interval_ms == 0
    {
        return Err(
            "fleet.probe_interval_ms, probe_timeout_ms, eject_base_ms, request_window_ms and keepalive_interval_ms must be at least 1".into(),
        );
    }
    if fleet.eject_max_ms < fleet.eject_base_ms {
        return Err("fleet.eject_max_ms must be at least fleet.eject_base_ms".into());
    }
    if !(PREFIX_BLOCK_BYTES..=MAX_PREFIX_BYTES).contains(&fleet.prefix_bytes) {
        return Err(format!(
            "fleet.prefix_bytes must be between {PREFIX_BLOCK_BYTES} and {MAX_PREFIX_BYTES} (got {})",
            fleet.prefix_bytes
        ));
    }
    if !(1..=MAX_PREFIX_TRACKED).contains(&fleet.prefix_tracked) {
        return Err(format!(
            "fleet.prefix_tracked must be between 1 and {MAX_PREFIX_TRACKED} (got {})",
            fleet.prefix_tracked
        ));
    }
    if !(fleet.prefix_imbalance_abs.is_finite() && fleet.prefix_imbalance_abs >= 0.0) {
        return Err(format!(
            "fleet.prefix_imbalance_abs must be 0 or more (got {})",
            fleet.prefix_imbalance_abs
        ));
    }
    if !(fleet.prefix_imbalance_rel.is_finite() && fleet.prefix_imbalance_rel >= 1.0) {
        return Err(format!(
            "fleet.prefix_imbalance_rel must be at least 1 (got {})",
            fleet.prefix_imbalance_rel
        ));
    }
    Ok(())
}

fn jobs(jobs: &JobSettings) -> Result<(), String> {
    if jobs.lease_ms < 300 || jobs.poll_interval_ms == 0 || jobs.sweep_interval_ms == 0 {
        return Err(
            "jobs.lease_ms must be at least 300, jobs.poll_interval_ms and sweep_interval_ms at least 1".into(),
        );
    }
    if jobs.max_waiters > jobs::MAX_WAITERS {
        return Err(format!(
            "jobs.max_waiters must be at most {} (got {})",
            jobs::MAX_WAITERS,
            jobs.max_waiters
        ));
    }
    if jobs.max_attempts == 0 || jobs.run_timeout_ms == 0 {
        return Err("jobs.max_attempts and jobs.run_timeout_ms must be at least 1".into());
    }
    if jobs.max_pending_bytes_per_key == 0 {
        return Err("jobs.max_pending_bytes_per_key must be at least 1".into());
    }
    Ok(())
}

fn traces(traces: &TraceSettings) -> Result<(), String> {
    if !(0.0..=1.0).contains(&traces.sample_ratio) {
        return Err(format!(
            "traces.sample_ratio must be between 0 and 1 (got {})",
            traces.sample_ratio
        ));
    }
    if let Some(endpoint) = traces.otlp_endpoint.as_deref()
        && !is_http_url(endpoint)
    {
        return Err(format!(
            "traces.otlp_endpoint must be an http(s) URL (got '{endpoint}')"
        ));
    }
    Ok(())
}

fn is_http_url(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
}

#[cfg(test)]
mod tests {
    use crate::config::schema::tests::{document, parse};

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
}
