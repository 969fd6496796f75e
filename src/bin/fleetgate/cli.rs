//! The `fleetgate keys …` commands: what they do to the store and what they print.
//!
//! Each command takes what it needs (the store, the configured limit defaults) and
//! returns the text to print; `main.rs` only parses arguments and dispatches. The value
//! parsers for the limit flags are here too, so the bounds live next to their use.

use serde_json::json;

use fleetgate::admission::{KeyLimits, Month};
use fleetgate::config::LimitDefaults;
use fleetgate::keys;
use fleetgate::store::{KeyRecord, LimitOverrides, LimitUpdate, Store};

/// A limit flag of `keys set`: a value, or `default` to drop the key's own value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting<T> {
    /// Back to the configured default.
    Default,
    Value(T),
}

impl<T> Setting<T> {
    /// The store's reading: `None` is the default.
    pub fn into_option(self) -> Option<T> {
        match self {
            Self::Default => None,
            Self::Value(v) => Some(v),
        }
    }
}

/// The largest value a limit column holds (PostgreSQL `INTEGER`).
const LIMIT_MAX: u32 = i32::MAX as u32;
/// The largest monthly budget (PostgreSQL `BIGINT`).
const BUDGET_MAX: u64 = i64::MAX as u64;

/// `--monthly-budget`: tokens, 0 up to `i64::MAX` (`_` separators allowed).
pub fn budget_arg(s: &str) -> Result<u64, String> {
    parse_number(s, 0, BUDGET_MAX)
}

/// `--rpm`, `--max-concurrent`: at least 1.
pub fn at_least_one_arg(s: &str) -> Result<u32, String> {
    parse_number(s, 1, u64::from(LIMIT_MAX)).map(narrow)
}

/// `--max-queued`: 0 or more.
pub fn queue_arg(s: &str) -> Result<u32, String> {
    parse_number(s, 0, u64::from(LIMIT_MAX)).map(narrow)
}

/// `--monthly-budget` of `keys set`: tokens or `default`.
pub fn budget_setting(s: &str) -> Result<Setting<u64>, String> {
    setting(s, budget_arg)
}

/// `--rpm`, `--max-concurrent` of `keys set`: at least 1, or `default`.
pub fn at_least_one_setting(s: &str) -> Result<Setting<u32>, String> {
    setting(s, at_least_one_arg)
}

/// `--max-queued` of `keys set`: 0 or more, or `default`.
pub fn queue_setting(s: &str) -> Result<Setting<u32>, String> {
    setting(s, queue_arg)
}

fn setting<T>(s: &str, parse: fn(&str) -> Result<T, String>) -> Result<Setting<T>, String> {
    if s.eq_ignore_ascii_case("default") {
        Ok(Setting::Default)
    } else {
        parse(s)
            .map(Setting::Value)
            .map_err(|e| format!("{e}, or 'default'"))
    }
}

fn parse_number(s: &str, min: u64, max: u64) -> Result<u64, String> {
    let digits: String = s.chars().filter(|&c| c != '_').collect();
    let expected = || format!("expected a whole number from {min} to {max}");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(expected());
    }
    digits
        .parse::<u64>()
        .ok()
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(expected)
}

fn narrow(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Creates a key with its initial limit overrides. Text output ends with the secret alone
/// on the last line, so scripts can take it with `tail -n1`; `--json` prints one object
/// with it as `secret`.
pub async fn create_key(
    store: &dyn Store,
    defaults: &LimitDefaults,
    name: &str,
    email: Option<&str>,
    limits: &LimitOverrides,
    as_json: bool,
) -> anyhow::Result<String> {
    let key = keys::generate();
    let record = store.create_key(name, email, &key, limits).await?;
    let secret = key.secret.expose();
    Ok(if as_json {
        let mut value = record_json(&record, defaults);
        value["secret"] = json!(secret);
        value.to_string()
    } else {
        format!(
            "Created key {} (id {}, name {:?}).\nLimits: {}.\nThe secret is shown only now:\n{secret}",
            record.prefix,
            record.id,
            record.name,
            limits_inline(&record.limits, defaults)
        )
    })
}

/// Lists keys with their effective limits (`*` marks a key's own value).
pub async fn list_keys(
    store: &dyn Store,
    defaults: &LimitDefaults,
    as_json: bool,
) -> anyhow::Result<String> {
    let records = store.list_keys().await?;
    if as_json {
        let list: Vec<_> = records.iter().map(|r| record_json(r, defaults)).collect();
        return Ok(serde_json::Value::Array(list).to_string());
    }
    let mut out = format!(
        "{:<6} {:<14} {:<8} {:<24} {:>14} {:>7} {:>6} {:>6}  {}",
        "ID", "PREFIX", "STATE", "NAME", "BUDGET/MONTH", "RPM", "CONC", "QUEUE", "EMAIL"
    );
    let mut any_own = false;
    for r in &records {
        let state = if r.is_active() { "active" } else { "revoked" };
        let own = r.limits;
        let eff = KeyLimits::resolve(defaults, &own);
        any_own |= own != LimitOverrides::default();
        out.push_str(&format!(
            "\n{:<6} {:<14} {:<8} {:<24} {:>14} {:>7} {:>6} {:>6}  {}",
            r.id,
            r.prefix,
            state,
            r.name,
            marked(eff.monthly_budget, own.monthly_budget.is_some()),
            marked(eff.requests_per_minute, own.requests_per_minute.is_some()),
            marked(eff.max_concurrent, own.max_concurrent.is_some()),
            marked(eff.max_queued, own.max_queued.is_some()),
            r.email.as_deref().unwrap_or("-")
        ));
    }
    if any_own {
        out.push_str("\n* the key's own limit; the others are the configured defaults");
    }
    Ok(out)
}

pub async fn revoke_key(store: &dyn Store, id_or_prefix: &str) -> anyhow::Result<String> {
    match store.revoke_key(id_or_prefix).await? {
        Some(record) => Ok(format!("Revoked key {} (id {}).", record.prefix, record.id)),
        None => anyhow::bail!("no key with id or prefix '{id_or_prefix}'"),
    }
}

/// Changes a key's limit overrides and prints its effective limits afterwards.
pub async fn set_limits(
    store: &dyn Store,
    defaults: &LimitDefaults,
    id_or_prefix: &str,
    update: &LimitUpdate,
) -> anyhow::Result<String> {
    let Some(record) = store.set_limits(id_or_prefix, update).await? else {
        anyhow::bail!("no key with id or prefix '{id_or_prefix}'");
    };
    Ok(format!(
        "Limits of key {} (id {}, name {:?}){}:\n{}",
        record.prefix,
        record.id,
        record.name,
        if record.is_active() { "" } else { ", revoked" },
        limits_table(&record.limits, defaults)
    ))
}

/// This month's used tokens (from the usage ledger), the effective limits and what is
/// left of the budget.
pub async fn key_usage(
    store: &dyn Store,
    defaults: &LimitDefaults,
    id_or_prefix: &str,
    as_json: bool,
) -> anyhow::Result<String> {
    let Some(record) = store.key(id_or_prefix).await? else {
        anyhow::bail!("no key with id or prefix '{id_or_prefix}'");
    };
    let month = Month::now();
    let used = store.month_usage(record.id, &month.to_string()).await?;
    let limits = KeyLimits::resolve(defaults, &record.limits);
    let remaining = limits.monthly_budget.saturating_sub(used);
    let resets = next_month(month);
    if as_json {
        let mut value = record_json(&record, defaults);
        value["month"] = json!(month.to_string());
        value["resets_at"] = json!(month.next_start_unix());
        value["used_tokens"] = json!(used);
        value["remaining_tokens"] = json!(remaining);
        return Ok(value.to_string());
    }
    Ok(format!(
        "Usage of key {} (id {}, name {:?}){} in {month} (UTC; the budget resets on \
         {resets}-01 00:00 UTC):\n{}\n{}\n{}\n\
         Used tokens are those of finished requests, from the usage ledger; tokens reserved\n\
         by requests still running are known only to the running server.",
        record.prefix,
        record.id,
        record.name,
        if record.is_active() { "" } else { ", revoked" },
        table_line("used", format!("{used} tokens")),
        table_line("remaining", format!("{remaining} tokens")),
        limits_table(&record.limits, defaults)
    ))
}

/// The month after `month`, for "resets on".
fn next_month(month: Month) -> Month {
    if month.month >= 12 {
        Month {
            year: month.year + 1,
            month: 1,
        }
    } else {
        Month {
            year: month.year,
            month: month.month + 1,
        }
    }
}

/// `value` with a `*` when it is the key's own.
fn marked(value: impl std::fmt::Display, own: bool) -> String {
    if own {
        format!("{value}*")
    } else {
        value.to_string()
    }
}

fn source(own: bool) -> &'static str {
    if own { "own" } else { "default" }
}

/// A `label value` line of the `keys set`/`keys usage` tables.
fn table_line(label: &str, value: String) -> String {
    format!("  {label:<17}{value}")
}

/// One limit per line, with where it comes from.
fn limits_table(own: &LimitOverrides, defaults: &LimitDefaults) -> String {
    let eff = KeyLimits::resolve(defaults, own);
    [
        (
            "monthly budget",
            format!("{} tokens", eff.monthly_budget),
            own.monthly_budget.is_some(),
        ),
        (
            "requests/minute",
            eff.requests_per_minute.to_string(),
            own.requests_per_minute.is_some(),
        ),
        (
            "max concurrent",
            eff.max_concurrent.to_string(),
            own.max_concurrent.is_some(),
        ),
        (
            "max queued",
            eff.max_queued.to_string(),
            own.max_queued.is_some(),
        ),
    ]
    .iter()
    .map(|(label, value, is_own)| table_line(label, format!("{value} ({})", source(*is_own))))
    .collect::<Vec<_>>()
    .join("\n")
}

/// All limits on one line, with where each comes from.
fn limits_inline(own: &LimitOverrides, defaults: &LimitDefaults) -> String {
    let eff = KeyLimits::resolve(defaults, own);
    format!(
        "{} tokens/month ({}), {} requests/minute ({}), {} concurrent ({}), {} queued ({})",
        eff.monthly_budget,
        source(own.monthly_budget.is_some()),
        eff.requests_per_minute,
        source(own.requests_per_minute.is_some()),
        eff.max_concurrent,
        source(own.max_concurrent.is_some()),
        eff.max_queued,
        source(own.max_queued.is_some()),
    )
}

/// A key as JSON: `limits` are the effective ones, `overrides` the key's own (`null`: the
/// configured default).
fn record_json(record: &KeyRecord, defaults: &LimitDefaults) -> serde_json::Value {
    let own = &record.limits;
    let eff = KeyLimits::resolve(defaults, own);
    json!({
        "id": record.id,
        "name": record.name,
        "email": record.email,
        "prefix": record.prefix,
        "created_at": record.created_at,
        "revoked_at": record.revoked_at,
        "active": record.is_active(),
        "limits": {
            "monthly_budget_tokens": eff.monthly_budget,
            "requests_per_minute": eff.requests_per_minute,
            "max_concurrent": eff.max_concurrent,
            "max_queued": eff.max_queued,
        },
        "overrides": {
            "monthly_budget_tokens": own.monthly_budget,
            "requests_per_minute": own.requests_per_minute,
            "max_concurrent": own.max_concurrent,
            "max_queued": own.max_queued,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_args() {
        assert_eq!(budget_arg("0"), Ok(0));
        assert_eq!(budget_arg("10_000_000"), Ok(10_000_000));
        assert_eq!(budget_arg(&i64::MAX.to_string()), Ok(BUDGET_MAX));
        assert!(budget_arg(&(BUDGET_MAX + 1).to_string()).is_err());
        for bad in ["", "_", "-1", "+1", "1.5", "1e6", "ten", " 1"] {
            assert!(budget_arg(bad).is_err(), "{bad:?}");
        }
        assert!(at_least_one_arg("0").is_err());
        assert_eq!(at_least_one_arg("1"), Ok(1));
        assert!(at_least_one_arg("2147483648").is_err());
        assert_eq!(queue_arg("0"), Ok(0));
        assert_eq!(queue_arg("2147483647"), Ok(LIMIT_MAX));

        assert_eq!(budget_setting("default"), Ok(Setting::Default));
        assert_eq!(queue_setting("DEFAULT"), Ok(Setting::Default));
        assert_eq!(at_least_one_setting("5"), Ok(Setting::Value(5)));
        let err = at_least_one_setting("0").unwrap_err();
        assert!(err.contains("'default'"), "{err}");
    }

    fn defaults() -> LimitDefaults {
        LimitDefaults {
            enabled: true,
            monthly_budget_tokens: 1_000,
            requests_per_minute: 600,
            max_concurrent: 16,
            max_queued: 64,
        }
    }

    #[tokio::test]
    async fn create_set_usage_list() {
        let store = fleetgate::store::connect("sqlite::memory:").await.unwrap();
        let store = store.as_ref();
        let defaults = defaults();
        let own = LimitOverrides {
            requests_per_minute: Some(5),
            ..LimitOverrides::default()
        };

        let out = create_key(store, &defaults, "alice", None, &own, false)
            .await
            .unwrap();
        let secret = out.lines().last().unwrap();
        assert!(secret.starts_with("fg-") && !secret.contains(' '), "{out}");
        assert!(
            out.contains("5 requests/minute (own)") && out.contains("1000 tokens/month (default)"),
            "{out}"
        );
        let prefix = &secret[..keys::PREFIX_LEN];
        let record = store.key(prefix).await.unwrap().unwrap();

        let json: serde_json::Value = serde_json::from_str(
            &create_key(
                store,
                &defaults,
                "bob",
                None,
                &LimitOverrides::default(),
                true,
            )
            .await
            .unwrap(),
        )
        .unwrap();
        assert_eq!(json["limits"]["requests_per_minute"], 600);
        assert_eq!(
            json["overrides"]["requests_per_minute"],
            serde_json::Value::Null
        );

        // Set a budget, drop the rate override.
        let update = LimitUpdate {
            monthly_budget: Some(Some(500)),
            requests_per_minute: Some(None),
            ..LimitUpdate::default()
        };
        let out = set_limits(store, &defaults, prefix, &update).await.unwrap();
        assert!(out.contains("  monthly budget   500 tokens (own)"), "{out}");
        assert!(out.contains("  requests/minute  600 (default)"), "{out}");
        assert!(
            set_limits(store, &defaults, "fg-nosuchkey", &update)
                .await
                .is_err()
        );

        // Usage of this month from the ledger.
        store
            .record_usage(&fleetgate::store::UsageRow {
                key_id: record.id,
                request_id: "req_1".to_owned(),
                month: Month::now().to_string(),
                prompt_tokens: 100,
                completion_tokens: 20,
                created_at: 0,
            })
            .await
            .unwrap();
        let out = key_usage(store, &defaults, &record.id.to_string(), false)
            .await
            .unwrap();
        assert!(out.contains("  used             120 tokens\n"), "{out}");
        assert!(out.contains("  remaining        380 tokens\n"), "{out}");
        assert!(out.contains("running server"), "{out}");
        let json: serde_json::Value =
            serde_json::from_str(&key_usage(store, &defaults, prefix, true).await.unwrap())
                .unwrap();
        assert_eq!(json["used_tokens"], 120);
        assert_eq!(json["remaining_tokens"], 380);
        assert_eq!(json["limits"]["monthly_budget_tokens"], 500);
        assert_eq!(json["month"], Month::now().to_string());
        assert!(key_usage(store, &defaults, "12345", false).await.is_err());

        let out = list_keys(store, &defaults, false).await.unwrap();
        let alice = out.lines().find(|l| l.contains("alice")).unwrap();
        assert!(alice.contains("500*") && alice.contains(" 600 "), "{out}");
        assert!(out.contains("* the key's own limit"), "{out}");
    }

    #[test]
    fn next_months() {
        let next = next_month(Month {
            year: 2026,
            month: 12,
        });
        assert_eq!(next.to_string(), "2027-01");
        let next = next_month(Month {
            year: 2026,
            month: 5,
        });
        assert_eq!(next.to_string(), "2026-06");
    }
}
