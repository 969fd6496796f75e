//! The `fleetgate keys …` commands: what they print of what the key service
//! ([`fleetgate::keys::KeyService`]) does.
//!
//! Each command takes what it needs (the store, the configured limit defaults) and
//! returns the text to print; `main.rs` only parses arguments and dispatches. The value
//! parsers for the limit flags are here too: they read a number and hand it to the key
//! service's check, so a bad value stops the command, naming the flag, before the store
//! is opened.

use serde_json::json;

use fleetgate::admission::{KeyLimits, Month};
use fleetgate::config::LimitDefaults;
use fleetgate::key_limits::{Limit, LimitInput};
use fleetgate::keys::{
    KeyError, KeyService, LimitsChange, MAX_EXPIRES_AT, MAX_GRACE_SECS, NewLimits,
};
use fleetgate::store::{KeyRecord, LimitOverrides, Store, now_unix};
use fleetgate::times::{format_duration, format_time, parse_duration, parse_time};

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

/// The flag of each limit, to name it in errors.
pub fn flag(limit: Limit) -> &'static str {
    match limit {
        Limit::MonthlyBudget => "--monthly-budget",
        Limit::RequestsPerMinute => "--rpm",
        Limit::MaxConcurrent => "--max-concurrent",
        Limit::MaxQueued => "--max-queued",
        Limit::Share => "--share",
    }
}

/// The value parser of a limit flag of `keys create`: a whole number (`_` separators
/// allowed) within the key service's bounds for `limit`. The message says what the value
/// must be; clap names the flag.
pub fn limit_arg(limit: Limit) -> impl Fn(&str) -> Result<LimitInput, String> + Clone {
    move |s| {
        let input = read_number(s);
        limit
            .check_input::<u64>(&input)
            .map(|_| input)
            .map_err(|err| err.requirement())
    }
}

/// The value parser of a limit flag of `keys set`: as [`limit_arg`], or `default`.
pub fn limit_setting(limit: Limit) -> impl Fn(&str) -> Result<Setting<LimitInput>, String> + Clone {
    let value = limit_arg(limit);
    move |s| {
        if s.eq_ignore_ascii_case("default") {
            Ok(Setting::Default)
        } else {
            value(s)
                .map(Setting::Value)
                .map_err(|e| format!("{e}, or 'default'"))
        }
    }
}

/// A flag's text as a number if it is one (digits, a leading `-`, `_` separators),
/// else as it was given.
fn read_number(s: &str) -> LimitInput {
    let digits: String = s.chars().filter(|&c| c != '_').collect();
    let unsigned = digits.strip_prefix('-').unwrap_or(&digits);
    let number = !unsigned.is_empty() && unsigned.bytes().all(|b| b.is_ascii_digit());
    match digits.parse() {
        Ok(n) if number => LimitInput::Whole(n),
        _ => LimitInput::Other(s.to_owned()),
    }
}

/// The key service's refusal as the CLI says it: a bad limit by its flag.
fn cli_error(err: KeyError) -> anyhow::Error {
    match err {
        KeyError::InvalidLimit(err) => {
            anyhow::anyhow!("{} {}", flag(err.limit()), err.requirement())
        }
        other => other.into(),
    }
}

/// The value parser of `--expires`: how long from now (`90d`), an RFC 3339 time or a
/// UTC day, as Unix seconds.
pub fn expiry_arg(value: &str) -> Result<i64, String> {
    let at = match parse_duration(value) {
        Some(secs) => i64::try_from(secs)
            .ok()
            .and_then(|secs| now_unix().checked_add(secs)),
        None => parse_time(value),
    };
    at.filter(|at| (0..=MAX_EXPIRES_AT).contains(at))
        .ok_or_else(|| {
            format!(
                "expected how long from now (90d, 12h), an RFC 3339 time (2027-01-01T00:00:00Z) \
             or a UTC day (2027-01-01), up to 9999-12-31, got '{value}'"
            )
        })
}

/// The value parser of `keys set --expires`: as [`expiry_arg`], or `never`.
pub fn expiry_setting(value: &str) -> Result<Setting<i64>, String> {
    if value.eq_ignore_ascii_case("never") {
        Ok(Setting::Default)
    } else {
        expiry_arg(value)
            .map(Setting::Value)
            .map_err(|e| format!("{e}, or 'never'"))
    }
}

/// The value parser of `keys rotate --grace`: a duration up to the key service's
/// maximum, in seconds.
pub fn grace_arg(value: &str) -> Result<u64, String> {
    match parse_duration(value) {
        Some(secs) if secs <= MAX_GRACE_SECS => Ok(secs),
        Some(secs) => Err(KeyError::GraceTooLong(secs).to_string()),
        None => Err(format!(
            "expected a duration such as 90s, 15m, 2h or 7d (at most {}), or 0, got '{value}'",
            format_duration(MAX_GRACE_SECS)
        )),
    }
}

/// What `keys create` makes.
pub struct NewKey<'a> {
    pub name: &'a str,
    pub email: Option<&'a str>,
    pub limits: NewLimits,
    /// Unix seconds; `None`: never.
    pub expires_at: Option<i64>,
}

/// Creates a key with its initial limit overrides and expiry. Text output ends with the
/// secret alone on the last line, so scripts can take it with `tail -n1`; `--json`
/// prints one object with it as `secret`.
pub async fn create_key(
    store: &dyn Store,
    defaults: &LimitDefaults,
    new: &NewKey<'_>,
    as_json: bool,
) -> anyhow::Result<String> {
    let issued = KeyService::new(store, defaults)
        .create(new.name, new.email, &new.limits, new.expires_at)
        .await
        .map_err(cli_error)?;
    let (record, secret) = (issued.record, issued.secret.expose());
    Ok(if as_json {
        let mut value = record_json(&record, defaults);
        value["secret"] = json!(secret);
        value.to_string()
    } else {
        let expires = match record.expires_at {
            Some(at) => format!("\nExpires: {}.", expiry_text(at, now_unix())),
            None => String::new(),
        };
        format!(
            "Created key {} (id {}, name {:?}).\nLimits: {}.{expires}\nThe secret is shown only now:\n{secret}",
            record.prefix,
            record.id,
            record.name,
            limits_inline(&record.limits, defaults)
        )
    })
}

/// Gives a key a new secret; the replaced one works for `grace_secs` more. Text output
/// ends with the new secret alone on the last line, as `keys create`'s; `--json` prints
/// one object with it as `secret`.
pub async fn rotate_key(
    store: &dyn Store,
    defaults: &LimitDefaults,
    id_or_prefix: &str,
    grace_secs: u64,
    as_json: bool,
) -> anyhow::Result<String> {
    let issued = KeyService::new(store, defaults)
        .rotate(id_or_prefix, grace_secs)
        .await
        .map_err(cli_error)?;
    let (record, secret) = (issued.record, issued.secret.expose());
    if as_json {
        let mut value = record_json(&record, defaults);
        value["secret"] = json!(secret);
        return Ok(value.to_string());
    }
    let previous = match record.previous_secret_expires_at(now_unix()) {
        Some(at) => format!(
            "The previous secret keeps working until {} (a grace of {}); then only the new one does.",
            format_time(at),
            format_duration(grace_secs)
        ),
        None => "The previous secret stopped working now.".to_owned(),
    };
    Ok(format!(
        "Rotated key {} (id {}, name {:?}): same prefix, limits, usage and budget, a new secret.\n\
         {previous}\nThe new secret is shown only now:\n{secret}",
        record.prefix, record.id, record.name,
    ))
}

/// Lists keys with their effective limits (`*` marks a key's own value).
pub async fn list_keys(
    store: &dyn Store,
    defaults: &LimitDefaults,
    as_json: bool,
) -> anyhow::Result<String> {
    let records = KeyService::new(store, defaults)
        .list()
        .await
        .map_err(cli_error)?;
    if as_json {
        let list: Vec<_> = records.iter().map(|r| record_json(r, defaults)).collect();
        return Ok(serde_json::Value::Array(list).to_string());
    }
    let mut out = format!(
        "{:<6} {:<14} {:<8} {:<24} {:>14} {:>7} {:>6} {:>6} {:>5}  {}",
        "ID", "PREFIX", "STATE", "NAME", "BUDGET/MONTH", "RPM", "CONC", "QUEUE", "SHARE", "EMAIL"
    );
    let mut any_own = false;
    let now = now_unix();
    for r in &records {
        let state = state(r, now);
        let own = r.limits;
        let eff = KeyLimits::resolve(defaults, &own);
        any_own |= own != LimitOverrides::default();
        out.push_str(&format!(
            "\n{:<6} {:<14} {:<8} {:<24} {:>14} {:>7} {:>6} {:>6} {:>5}  {}",
            r.id,
            r.prefix,
            state,
            printable(&r.name),
            marked(eff.monthly_budget, own.monthly_budget.is_some()),
            marked(eff.requests_per_minute, own.requests_per_minute.is_some()),
            marked(eff.max_concurrent, own.max_concurrent.is_some()),
            marked(eff.max_queued, own.max_queued.is_some()),
            marked(eff.share, own.share.is_some()),
            printable(r.email.as_deref().unwrap_or("-"))
        ));
    }
    if any_own {
        out.push_str("\n* the key's own limit; the others are the configured defaults");
    }
    Ok(out)
}

/// `text` for a terminal: control characters (escape sequences included) shown as
/// escapes, so a key's name or email cannot drive the terminal of whoever lists keys.
fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return text.into();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

pub async fn revoke_key(
    store: &dyn Store,
    defaults: &LimitDefaults,
    id_or_prefix: &str,
) -> anyhow::Result<String> {
    let record = KeyService::new(store, defaults)
        .revoke(id_or_prefix)
        .await
        .map_err(cli_error)?;
    Ok(format!("Revoked key {} (id {}).", record.prefix, record.id))
}

/// Changes a key's limit overrides and (`Some`) its expiry, and prints its effective
/// limits and expiry afterwards.
pub async fn set_limits(
    store: &dyn Store,
    defaults: &LimitDefaults,
    id_or_prefix: &str,
    change: &LimitsChange,
    expires_at: Option<Option<i64>>,
) -> anyhow::Result<String> {
    let keys = KeyService::new(store, defaults);
    // The limits are checked (and a bad one refused) before the expiry is written.
    let mut record = keys
        .set_limits(id_or_prefix, change)
        .await
        .map_err(cli_error)?;
    if let Some(expires_at) = expires_at {
        record = keys
            .set_expiry(id_or_prefix, expires_at)
            .await
            .map_err(cli_error)?;
    }
    Ok(format!(
        "Limits of key {} (id {}, name {:?}){}:\n{}\n{}",
        record.prefix,
        record.id,
        record.name,
        state_note(&record, now_unix()),
        limits_table(&record.limits, defaults),
        expiry_lines(&record, now_unix())
    ))
}

/// `active`, `revoked` or `expired`.
fn state(record: &KeyRecord, now: i64) -> &'static str {
    if !record.is_active() {
        "revoked"
    } else if record.is_expired(now) {
        "expired"
    } else {
        "active"
    }
}

/// `, revoked` or `, expired` after a key's name; nothing for an active key.
fn state_note(record: &KeyRecord, now: i64) -> String {
    match state(record, now) {
        "active" => String::new(),
        other => format!(", {other}"),
    }
}

/// An expiry for people: `2027-01-01T00:00:00Z (in 25d)`, or `(passed)`.
fn expiry_text(at: i64, now: i64) -> String {
    let when = u64::try_from(at - now)
        .ok()
        .filter(|&secs| secs > 0)
        .map_or_else(
            || "passed".to_owned(),
            |secs| format!("in {}", rough_duration(secs)),
        );
    format!("{} ({when})", format_time(at))
}

/// A duration in its largest whole unit, rounded down (`25d`, `3h`).
fn rough_duration(secs: u64) -> String {
    let unit = [86_400, 3_600, 60, 1]
        .into_iter()
        .find(|&unit| secs >= unit)
        .unwrap_or(1);
    format_duration(secs / unit * unit)
}

/// The key's expiry, and its previous secret's while a rotation's grace lasts, as
/// `keys set`/`keys usage` table lines.
fn expiry_lines(record: &KeyRecord, now: i64) -> String {
    let mut lines = table_line(
        "expires",
        record
            .expires_at
            .map_or_else(|| "never".to_owned(), |at| expiry_text(at, now)),
    );
    if let Some(at) = record.previous_secret_expires_at(now) {
        lines.push('\n');
        lines.push_str(&table_line(
            "previous secret",
            format!("works until {}", expiry_text(at, now)),
        ));
    }
    lines
}

/// This month's used tokens (from the usage ledger), the effective limits and what is
/// left of the budget.
pub async fn key_usage(
    store: &dyn Store,
    defaults: &LimitDefaults,
    id_or_prefix: &str,
    as_json: bool,
) -> anyhow::Result<String> {
    let usage = KeyService::new(store, defaults)
        .usage(id_or_prefix, Month::now())
        .await
        .map_err(cli_error)?;
    let (record, month, used, remaining) = (usage.record, usage.month, usage.used, usage.remaining);
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
         {resets}-01 00:00 UTC):\n{}\n{}\n{}\n{}\n\
         Used tokens are those of finished requests, from the usage ledger; tokens reserved\n\
         by requests still running are known only to the running server.",
        record.prefix,
        record.id,
        record.name,
        state_note(&record, now_unix()),
        table_line("used", format!("{used} tokens")),
        table_line("remaining", format!("{remaining} tokens")),
        limits_table(&record.limits, defaults),
        expiry_lines(&record, now_unix())
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
        ("share", eff.share.to_string(), own.share.is_some()),
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
        "{} tokens/month ({}), {} requests/minute ({}), {} concurrent ({}), {} queued ({}), \
         share {} ({})",
        eff.monthly_budget,
        source(own.monthly_budget.is_some()),
        eff.requests_per_minute,
        source(own.requests_per_minute.is_some()),
        eff.max_concurrent,
        source(own.max_concurrent.is_some()),
        eff.max_queued,
        source(own.max_queued.is_some()),
        eff.share,
        source(own.share.is_some()),
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
        "expires_at": record.expires_at,
        "previous_secret_expires_at": record.previous_secret_expires_at(now_unix()),
        "active": record.is_usable(now_unix()),
        "limits": {
            "monthly_budget": eff.monthly_budget,
            "requests_per_minute": eff.requests_per_minute,
            "max_concurrent": eff.max_concurrent,
            "max_queued": eff.max_queued,
            "share": eff.share,
        },
        "overrides": {
            "monthly_budget": own.monthly_budget,
            "requests_per_minute": own.requests_per_minute,
            "max_concurrent": own.max_concurrent,
            "max_queued": own.max_queued,
            "share": own.share,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_args() {
        let budget = limit_arg(Limit::MonthlyBudget);
        assert_eq!(budget("0"), Ok(LimitInput::Whole(0)));
        assert_eq!(budget("10_000_000"), Ok(LimitInput::Whole(10_000_000)));
        assert_eq!(
            budget(&i64::MAX.to_string()),
            Ok(LimitInput::Whole(i64::MAX.into()))
        );
        assert_eq!(
            budget("9223372036854775808").unwrap_err(),
            "must be between 0 and 9223372036854775807 (got 9223372036854775808)"
        );
        assert_eq!(
            budget("-1").unwrap_err(),
            "must be between 0 and 9223372036854775807 (got -1)"
        );
        for bad in ["", "_", "-", "+1", "1.5", "1e6", "ten", " 1"] {
            assert_eq!(
                budget(bad).unwrap_err(),
                format!("must be a whole number between 0 and 9223372036854775807 (got {bad})")
            );
        }
        let rpm = limit_arg(Limit::RequestsPerMinute);
        assert_eq!(
            rpm("0").unwrap_err(),
            "must be between 1 and 2147483647 (got 0)"
        );
        assert_eq!(rpm("1"), Ok(LimitInput::Whole(1)));
        assert!(limit_arg(Limit::MaxConcurrent)("2147483648").is_err());
        let queued = limit_arg(Limit::MaxQueued);
        assert_eq!(queued("0"), Ok(LimitInput::Whole(0)));
        assert_eq!(queued("2147483647"), Ok(LimitInput::Whole(2_147_483_647)));
        assert_eq!(
            queued("3000000000").unwrap_err(),
            "must be between 0 and 2147483647 (got 3000000000)"
        );

        let share = limit_arg(Limit::Share);
        assert_eq!(share("1"), Ok(LimitInput::Whole(1)));
        assert_eq!(share("1000"), Ok(LimitInput::Whole(1000)));
        assert_eq!(
            share("0").unwrap_err(),
            "must be between 1 and 1000 (got 0)"
        );
        assert_eq!(
            share("1001").unwrap_err(),
            "must be between 1 and 1000 (got 1001)"
        );
        assert_eq!(limit_setting(Limit::Share)("default"), Ok(Setting::Default));

        assert_eq!(
            limit_setting(Limit::MonthlyBudget)("default"),
            Ok(Setting::Default)
        );
        assert_eq!(
            limit_setting(Limit::MaxQueued)("DEFAULT"),
            Ok(Setting::Default)
        );
        assert_eq!(
            limit_setting(Limit::RequestsPerMinute)("5"),
            Ok(Setting::Value(LimitInput::Whole(5)))
        );
        let err = limit_setting(Limit::RequestsPerMinute)("0").unwrap_err();
        assert_eq!(
            err,
            "must be between 1 and 2147483647 (got 0), or 'default'"
        );
    }

    #[test]
    fn a_bad_limit_is_named_by_its_flag() {
        let err = Limit::MaxQueued
            .check::<u32>(3_000_000_000_u32)
            .unwrap_err();
        assert_eq!(
            cli_error(err.into()).to_string(),
            "--max-queued must be between 0 and 2147483647 (got 3000000000)"
        );
        let err = Limit::RequestsPerMinute.check::<u32>(0_u32).unwrap_err();
        assert_eq!(
            cli_error(err.into()).to_string(),
            "--rpm must be between 1 and 2147483647 (got 0)"
        );
        assert_eq!(
            cli_error(KeyError::NotFound("fg-x".into())).to_string(),
            "no key with id or prefix 'fg-x'"
        );
    }

    fn defaults() -> LimitDefaults {
        LimitDefaults {
            enabled: true,
            monthly_budget: 1_000,
            requests_per_minute: 600,
            max_concurrent: 16,
            max_queued: 64,
            share: 1,
        }
    }

    fn named(name: &str, limits: NewLimits) -> NewKey<'_> {
        NewKey {
            name,
            email: None,
            limits,
            expires_at: None,
        }
    }

    #[test]
    fn expiry_and_grace_args() {
        let now = now_unix();
        let in_a_day = expiry_arg("1d").unwrap();
        assert!((now + 86_400..=now + 86_401).contains(&in_a_day));
        assert_eq!(expiry_arg("2027-01-01T00:00:00Z"), Ok(1_798_761_600));
        assert_eq!(expiry_arg("2027-01-01"), Ok(1_798_761_600));
        assert_eq!(expiry_arg("2027-01-01T01:00:00+01:00"), Ok(1_798_761_600));
        assert_eq!(expiry_setting("never"), Ok(Setting::Default));
        for bad in ["", "soon", "-1d", "1969-12-31", "2027-01-01T00:00:00"] {
            assert!(expiry_arg(bad).is_err(), "{bad}");
        }
        assert!(
            expiry_setting("soon")
                .unwrap_err()
                .ends_with(", or 'never'")
        );
        assert_eq!(grace_arg("0"), Ok(0));
        assert_eq!(grace_arg("90s"), Ok(90));
        assert_eq!(grace_arg("30d"), Ok(2_592_000));
        assert_eq!(
            grace_arg("31d").unwrap_err(),
            "the grace period must be at most 30d (2592000 seconds), got 31d (2678400 seconds)"
        );
        assert!(
            grace_arg("1w")
                .unwrap_err()
                .starts_with("expected a duration")
        );
    }

    /// `keys rotate` prints the new secret alone on the last line and when the old one
    /// stops; `keys set --expires` and `keys usage` show the expiry and the grace.
    #[tokio::test]
    async fn rotate_and_expire() {
        let store = fleetgate::store::connect("sqlite::memory:").await.unwrap();
        let store = store.as_ref();
        let defaults = defaults();
        let new = NewKey {
            expires_at: Some(now_unix() + 2 * 86_400 + 30),
            ..named("carol", NewLimits::default())
        };
        let out = create_key(store, &defaults, &new, false).await.unwrap();
        assert!(out.contains("\nExpires: "), "{out}");
        assert!(out.contains(" (in 2d).\n"), "{out}");
        let first = out.lines().last().unwrap().to_owned();
        let prefix = &first[..fleetgate::key_secret::PREFIX_LEN];

        let out = rotate_key(store, &defaults, prefix, 7_200, false)
            .await
            .unwrap();
        let second = out.lines().last().unwrap();
        assert!(second.starts_with(prefix) && second != first, "{out}");
        assert!(
            out.starts_with(&format!("Rotated key {prefix} (id 1, name \"carol\")")),
            "{out}"
        );
        assert!(out.contains("keeps working until "), "{out}");
        assert!(
            out.contains("(a grace of 2h); then only the new one does."),
            "{out}"
        );
        let out = key_usage(store, &defaults, prefix, false).await.unwrap();
        assert!(out.contains("  previous secret  works until "), "{out}");
        // Two hours from the rotation, or just under them by now.
        assert!(
            out.contains(" (in 2h)") || out.contains(" (in 1h)"),
            "{out}"
        );

        let json: serde_json::Value =
            serde_json::from_str(&rotate_key(store, &defaults, "1", 0, true).await.unwrap())
                .unwrap();
        let third = json["secret"].as_str().unwrap();
        assert!(third.starts_with(prefix) && third != second, "{json}");
        assert_eq!(json["previous_secret_expires_at"], serde_json::Value::Null);
        assert_eq!(json["active"], true);
        let out = rotate_key(store, &defaults, "1", 0, false).await.unwrap();
        assert!(
            out.contains("\nThe previous secret stopped working now.\n"),
            "{out}"
        );

        let no_change = LimitsChange::default();
        let out = set_limits(store, &defaults, prefix, &no_change, Some(Some(1)))
            .await
            .unwrap();
        assert!(out.contains("(id 1, name \"carol\"), expired:"), "{out}");
        assert!(
            out.contains("  expires          1970-01-01T00:00:01Z (passed)"),
            "{out}"
        );
        let list = list_keys(store, &defaults, false).await.unwrap();
        assert!(list.contains(" expired  carol"), "{list}");
        let out = set_limits(store, &defaults, prefix, &no_change, Some(None))
            .await
            .unwrap();
        assert!(out.contains("  expires          never"), "{out}");

        revoke_key(store, &defaults, prefix).await.unwrap();
        let err = rotate_key(store, &defaults, prefix, 0, false)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("is revoked"), "{err}");
    }

    #[tokio::test]
    async fn create_set_usage_list() {
        let store = fleetgate::store::connect("sqlite::memory:").await.unwrap();
        let store = store.as_ref();
        let defaults = defaults();
        let own = NewLimits {
            requests_per_minute: Some(LimitInput::Whole(5)),
            share: Some(LimitInput::Whole(3)),
            ..NewLimits::default()
        };

        let out = create_key(store, &defaults, &named("alice", own), false)
            .await
            .unwrap();
        let secret = out.lines().last().unwrap();
        assert!(secret.starts_with("fg-") && !secret.contains(' '), "{out}");
        assert!(
            out.contains("5 requests/minute (own)") && out.contains("1000 tokens/month (default)"),
            "{out}"
        );
        assert!(out.contains("share 3 (own)"), "{out}");
        let prefix = &secret[..fleetgate::key_secret::PREFIX_LEN];
        let record = store.key(prefix).await.unwrap().unwrap();

        let json: serde_json::Value = serde_json::from_str(
            &create_key(store, &defaults, &named("bob", NewLimits::default()), true)
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(json["limits"]["requests_per_minute"], 600);
        assert_eq!(
            json["overrides"]["requests_per_minute"],
            serde_json::Value::Null
        );
        assert_eq!(json["limits"]["share"], 1);
        assert_eq!(json["overrides"]["share"], serde_json::Value::Null);

        // Set a budget, drop the rate override.
        let update = LimitsChange {
            monthly_budget: Some(Some(LimitInput::Whole(500))),
            requests_per_minute: Some(None),
            ..LimitsChange::default()
        };
        let out = set_limits(store, &defaults, prefix, &update, None)
            .await
            .unwrap();
        assert!(out.contains("  monthly budget   500 tokens (own)"), "{out}");
        assert!(out.contains("  requests/minute  600 (default)"), "{out}");
        assert!(out.contains("  share            3 (own)"), "{out}");
        assert!(
            set_limits(store, &defaults, "fg-nosuchkey", &update, None)
                .await
                .is_err()
        );
        // A bad value reaching the service (the flag parser stops it first) is named by
        // its flag, and changes nothing.
        let bad_queue = LimitsChange {
            max_queued: Some(Some(LimitInput::Whole(3_000_000_000))),
            ..LimitsChange::default()
        };
        let bad_share = LimitsChange {
            share: Some(Some(LimitInput::Whole(0))),
            ..LimitsChange::default()
        };
        for (bad, named) in [
            (
                bad_queue,
                "--max-queued must be between 0 and 2147483647 (got 3000000000)",
            ),
            (bad_share, "--share must be between 1 and 1000 (got 0)"),
        ] {
            let err = set_limits(store, &defaults, prefix, &bad, None)
                .await
                .unwrap_err();
            assert_eq!(err.to_string(), named);
        }

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
        assert_eq!(json["limits"]["monthly_budget"], 500);
        assert_eq!(
            (&json["limits"]["share"], &json["overrides"]["share"]),
            (&json!(3), &json!(3))
        );
        assert_eq!(json["month"], Month::now().to_string());
        assert!(key_usage(store, &defaults, "12345", false).await.is_err());

        let out = list_keys(store, &defaults, false).await.unwrap();
        let alice = out.lines().find(|l| l.contains("alice")).unwrap();
        assert!(alice.contains("500*") && alice.contains(" 600 "), "{out}");
        assert!(alice.contains(" 3* "), "{out}");
        let bob = out.lines().find(|l| l.contains("bob")).unwrap();
        assert!(bob.ends_with("     1  -"), "the default share: {out}");
        assert!(out.contains("* the key's own limit"), "{out}");
    }

    #[tokio::test]
    async fn key_names_cannot_send_escape_sequences_to_the_terminal() {
        let store = fleetgate::store::connect("sqlite::memory:").await.unwrap();
        let store = store.as_ref();
        let defaults = defaults();
        let name = "evil\u{1b}]0;pwned\u{7}\u{1b}[2J\r";
        let new = NewKey {
            email: Some("x\u{1b}[31m@y"),
            ..named(name, NewLimits::default())
        };
        create_key(store, &defaults, &new, false).await.unwrap();
        let out = list_keys(store, &defaults, false).await.unwrap();
        assert!(!out.contains(['\u{1b}', '\u{7}', '\r']), "{out:?}");
        assert!(out.contains(r"evil\u{1b}]0;pwned\u{7}\u{1b}[2J\r"), "{out}");
        assert!(out.contains(r"x\u{1b}[31m@y"), "{out}");
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
