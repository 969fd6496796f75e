//! Which settings a reload leaves for a restart: every setting but the models' nodes is
//! read once, at start-up (listeners, store, Redis, limits, the fleet's probing and
//! queueing, each model's own settings). A reload names those that changed so that
//! nobody takes them for applied.

use crate::config::{Config, ModelConfig};

/// The settings of `next` that differ from the running ones and need a restart: the
/// top-level key (or table, e.g. `fleet`), `models.<key> of '<id>'`, or a model added
/// or removed.
pub fn needing_restart(running: &Config, next: &Config) -> Vec<String> {
    // Destructured so that a new setting cannot be forgotten here.
    let Config {
        listen,
        ops_listen,
        admin_listen,
        tls,
        database_url,
        max_body_bytes,
        shutdown_grace_ms,
        log_format,
        connections,
        upstream,
        fleet,
        limits,
        redis_url,
        redis_key_prefix,
        redis_tls,
        admin_token,
        traces,
        workbench,
        jobs,
        request_log,
        models,
        source: _,
    } = running;
    let settings = [
        ("listen", *listen == next.listen),
        ("ops_listen", *ops_listen == next.ops_listen),
        ("admin_listen", *admin_listen == next.admin_listen),
        // The files named are read again on every reload; other names, or TLS turned
        // on or off, need a restart.
        ("tls", *tls == next.tls),
        ("database_url", *database_url == next.database_url),
        ("max_body_bytes", *max_body_bytes == next.max_body_bytes),
        (
            "shutdown_grace_ms",
            *shutdown_grace_ms == next.shutdown_grace_ms,
        ),
        ("log_format", *log_format == next.log_format),
        ("connections", *connections == next.connections),
        ("upstream", *upstream == next.upstream),
        ("fleet", *fleet == next.fleet),
        ("limits", *limits == next.limits),
        ("redis_url", *redis_url == next.redis_url),
        (
            "redis_key_prefix",
            *redis_key_prefix == next.redis_key_prefix,
        ),
        ("redis_tls", *redis_tls == next.redis_tls),
        ("admin_token", *admin_token == next.admin_token),
        ("traces", *traces == next.traces),
        ("workbench", *workbench == next.workbench),
        ("jobs", *jobs == next.jobs),
        ("request_log", *request_log == next.request_log),
    ];
    let mut changed: Vec<String> = settings
        .into_iter()
        .filter(|(_, same)| !same)
        .map(|(name, _)| name.to_owned())
        .collect();
    for model in models {
        match next.models.iter().find(|m| m.id == model.id) {
            Some(reloaded) => changed.extend(
                model_settings(model, reloaded)
                    .into_iter()
                    .map(|key| format!("models.{key} of '{}'", model.id)),
            ),
            None => changed.push(format!("models: '{}' removed", model.id)),
        }
    }
    for reloaded in &next.models {
        if !models.iter().any(|m| m.id == reloaded.id) {
            changed.push(format!("models: '{}' added", reloaded.id));
        }
    }
    changed
}

/// The keys of a model, other than its upstreams, that differ.
fn model_settings(running: &ModelConfig, next: &ModelConfig) -> Vec<&'static str> {
    let ModelConfig {
        id: _,
        default,
        max_logprobs,
        decode_tokens_per_second,
        wake_url,
        boot_timeout_ms,
        sleep_url,
        keep_warm_ms,
        idle_sleep_ms,
        routing,
        upstreams: _,
    } = running;
    [
        ("default", *default == next.default),
        ("max_logprobs", *max_logprobs == next.max_logprobs),
        (
            "decode_tokens_per_second",
            *decode_tokens_per_second == next.decode_tokens_per_second,
        ),
        ("wake_url", *wake_url == next.wake_url),
        ("boot_timeout_ms", *boot_timeout_ms == next.boot_timeout_ms),
        ("sleep_url", *sleep_url == next.sleep_url),
        ("keep_warm_ms", *keep_warm_ms == next.keep_warm_ms),
        ("idle_sleep_ms", *idle_sleep_ms == next.idle_sleep_ms),
        ("routing", *routing == next.routing),
    ]
    .into_iter()
    .filter(|(_, same)| !same)
    .map(|(key, _)| key)
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(top: &str, model: &str, upstream: &str) -> Config {
        Config::from_toml(&format!(
            "{top}\n[[models]]\nid = \"m\"\n{model}\n[[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"g\"\n"
        ))
        .unwrap()
    }

    #[test]
    fn only_settings_other_than_the_nodes_are_named() {
        let running = config("", "", "http://10.0.0.1:8000");
        let nodes_only = config("", "", "http://10.0.0.2:8000");
        assert!(needing_restart(&running, &nodes_only).is_empty());
        let others = config(
            "listen = \"0.0.0.0:9000\"\nredis_url = \"redis://r:6379\"\n[fleet]\nqueue_size = 3",
            "routing = \"load\"",
            "http://10.0.0.1:8000",
        );
        assert_eq!(
            needing_restart(&running, &others),
            ["listen", "fleet", "redis_url", "models.routing of 'm'"]
        );
    }

    #[test]
    fn models_added_or_removed_are_named() {
        let running = config("", "", "http://10.0.0.1:8000");
        let mut next = running.clone();
        next.models[0].id = "n".into();
        assert_eq!(
            needing_restart(&running, &next),
            ["models: 'm' removed", "models: 'n' added"]
        );
    }
}
