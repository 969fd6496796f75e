//! The mapping both backends share between the records and their columns: which key
//! `id_or_prefix` selects, limit and usage values checked into column types, rows read
//! back, insert errors, the clock.

use std::time::{SystemTime, UNIX_EPOCH};

use super::records::{KeyRecord, LimitOverrides, LimitUpdate, RequestLogRow, StoreError, UsageRow};
use crate::key_limits::Limit;

/// How `key`, `revoke_key` and `set_limits` read `id_or_prefix`: all ASCII digits is an id (prefixes start with
/// `fg-`, so the two never overlap); `Id(None)` is an id too large to exist. Anything else
/// is looked up as a prefix.
pub(super) enum KeySelector<'a> {
    Id(Option<i64>),
    Prefix(&'a str),
}

impl<'a> KeySelector<'a> {
    pub(super) fn parse(id_or_prefix: &'a str) -> Self {
        if !id_or_prefix.is_empty() && id_or_prefix.bytes().all(|b| b.is_ascii_digit()) {
            Self::Id(id_or_prefix.parse().ok())
        } else {
            Self::Prefix(id_or_prefix)
        }
    }
}

impl<'a> KeySelector<'a> {
    /// The `(id, prefix)` pair to bind to `WHERE id = ? OR prefix = ?` (the other one
    /// NULL, which matches nothing); None when no key can match: an id too large, or a
    /// prefix with a NUL character, which no stored text holds (and which PostgreSQL
    /// refuses to bind at all).
    pub(super) fn binds(&self) -> Option<(Option<i64>, Option<&'a str>)> {
        match *self {
            Self::Id(None) => None,
            Self::Id(Some(id)) => Some((Some(id), None)),
            Self::Prefix(prefix) if prefix.contains('\0') => None,
            Self::Prefix(prefix) => Some((None, Some(prefix))),
        }
    }
}

/// A text value as its column holds it: PostgreSQL's `TEXT` cannot hold a NUL
/// character, so a value with one is [`StoreError::Invalid`] on both backends (rather
/// than a database error on one of them).
pub(super) fn text_column<'v>(field: &str, value: &'v str) -> Result<&'v str, StoreError> {
    if value.contains('\0') {
        return Err(StoreError::Invalid(format!(
            "{field} must not contain a NUL character (\\u0000)"
        )));
    }
    Ok(value)
}

/// Limit overrides as stored: `NULL` or a value the column can hold.
pub(super) struct LimitColumns {
    pub(super) monthly_budget: Option<i64>,
    pub(super) requests_per_minute: Option<i32>,
    pub(super) max_concurrent: Option<i32>,
    pub(super) max_queued: Option<i32>,
    pub(super) share: Option<i32>,
}

impl LimitColumns {
    pub(super) fn encode(limits: &LimitOverrides) -> Result<Self, StoreError> {
        Ok(Self {
            monthly_budget: limits.monthly_budget.map(budget_column).transpose()?,
            requests_per_minute: limits
                .requests_per_minute
                .map(|v| limit_column(Limit::RequestsPerMinute, v))
                .transpose()?,
            max_concurrent: limits
                .max_concurrent
                .map(|v| limit_column(Limit::MaxConcurrent, v))
                .transpose()?,
            max_queued: limits
                .max_queued
                .map(|v| limit_column(Limit::MaxQueued, v))
                .transpose()?,
            share: limits
                .share
                .map(|v| limit_column(Limit::Share, v))
                .transpose()?,
        })
    }
}

/// A [`LimitUpdate`] as bound to `SET col = CASE WHEN <change> THEN <value> ELSE col END`:
/// for each limit, whether to change it and the new value (`NULL`: the default).
pub(super) struct UpdateColumns {
    pub(super) monthly_budget: (bool, Option<i64>),
    pub(super) requests_per_minute: (bool, Option<i32>),
    pub(super) max_concurrent: (bool, Option<i32>),
    pub(super) max_queued: (bool, Option<i32>),
    pub(super) share: (bool, Option<i32>),
}

impl UpdateColumns {
    pub(super) fn encode(update: &LimitUpdate) -> Result<Self, StoreError> {
        fn change<T, C>(
            value: Option<Option<T>>,
            encode: impl FnOnce(T) -> Result<C, StoreError>,
        ) -> Result<(bool, Option<C>), StoreError> {
            Ok(match value {
                None => (false, None),
                Some(None) => (true, None),
                Some(Some(v)) => (true, Some(encode(v)?)),
            })
        }
        Ok(Self {
            monthly_budget: change(update.monthly_budget, budget_column)?,
            requests_per_minute: change(update.requests_per_minute, |v| {
                limit_column(Limit::RequestsPerMinute, v)
            })?,
            max_concurrent: change(update.max_concurrent, |v| {
                limit_column(Limit::MaxConcurrent, v)
            })?,
            max_queued: change(update.max_queued, |v| limit_column(Limit::MaxQueued, v))?,
            share: change(update.share, |v| limit_column(Limit::Share, v))?,
        })
    }
}

pub(super) fn budget_column(tokens: u64) -> Result<i64, StoreError> {
    Limit::MonthlyBudget
        .check(tokens)
        .map_err(|err| StoreError::Invalid(err.to_string()))
}

/// A `u32` limit as its `INTEGER` column holds it, within the limit's bounds.
pub(super) fn limit_column(limit: Limit, value: u32) -> Result<i32, StoreError> {
    limit
        .check(value)
        .map_err(|err| StoreError::Invalid(err.to_string()))
}

/// A [`UsageRow`]'s counts as stored, after checking the month.
pub(super) struct UsageColumns {
    pub(super) prompt_tokens: i64,
    pub(super) completion_tokens: i64,
}

impl UsageColumns {
    pub(super) fn encode(row: &UsageRow) -> Result<Self, StoreError> {
        if !is_month(&row.month) {
            return Err(StoreError::Invalid(format!(
                "usage month must be YYYY-MM (got {:?})",
                row.month
            )));
        }
        let tokens = |name: &str, n: u64| {
            i64::try_from(n).map_err(|_| {
                StoreError::Invalid(format!("{name} must be at most {} (got {n})", i64::MAX))
            })
        };
        Ok(Self {
            prompt_tokens: tokens("prompt_tokens", row.prompt_tokens)?,
            completion_tokens: tokens("completion_tokens", row.completion_tokens)?,
        })
    }
}

/// Whether `month` is `YYYY-MM` with a month 01–12 (what the schema's CHECK accepts).
pub(super) fn is_month(month: &str) -> bool {
    let b = month.as_bytes();
    b.len() == 7
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[5..].iter().all(u8::is_ascii_digit)
        && (b"01".as_slice()..=b"12".as_slice()).contains(&&b[5..])
}

/// A [`RequestLogRow`]'s non-text columns as stored. Never fails: counts beyond the
/// column saturate, so one odd row cannot make a whole batch fail.
pub(super) struct LogColumns {
    pub(super) client_ip: Option<String>,
    pub(super) prompt_tokens: Option<i64>,
    pub(super) completion_tokens: Option<i64>,
    pub(super) status: i32,
    pub(super) latency_ms: i64,
    pub(super) queue_wait_ms: Option<i64>,
}

impl LogColumns {
    pub(super) fn encode(row: &RequestLogRow) -> Self {
        let saturate = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        Self {
            client_ip: row.client_ip.map(|ip| ip.to_string()),
            prompt_tokens: row.prompt_tokens.map(saturate),
            completion_tokens: row.completion_tokens.map(saturate),
            status: i32::from(row.status),
            latency_ms: saturate(row.latency_ms),
            queue_wait_ms: row.queue_wait_ms.map(saturate),
        }
    }
}

/// Reads a stored value into the Rust type the column means, or a decode error naming
/// the column.
pub(super) fn convert<S, T>(value: S, column: &str) -> Result<T, sqlx::Error>
where
    T: TryFrom<S>,
    S: Copy + std::fmt::Display,
{
    T::try_from(value).map_err(|_| sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: format!("{value} is out of range").into(),
    })
}

pub(super) fn convert_opt<S, T>(value: Option<S>, column: &str) -> Result<Option<T>, sqlx::Error>
where
    T: TryFrom<S>,
    S: Copy + std::fmt::Display,
{
    value.map(|v| convert(v, column)).transpose()
}

/// Rows of both backends (SQLite and PostgreSQL) decode the same way: the limit columns
/// as `INTEGER` (i32) and `BIGINT` (i64).
impl<'r, R> sqlx::FromRow<'r, R> for KeyRecord
where
    R: sqlx::Row,
    &'r str: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        let limit = |column: &'r str| -> Result<Option<u32>, sqlx::Error> {
            convert_opt(row.try_get::<Option<i32>, _>(column)?, column)
        };
        Ok(Self {
            id: row.try_get("id")?,
            name: row.try_get("name")?,
            email: row.try_get("email")?,
            prefix: row.try_get("prefix")?,
            hash: row.try_get("key_hash")?,
            created_at: row.try_get("created_at")?,
            revoked_at: row.try_get("revoked_at")?,
            limits: LimitOverrides {
                monthly_budget: convert_opt(
                    row.try_get::<Option<i64>, _>("monthly_budget_tokens")?,
                    "monthly_budget_tokens",
                )?,
                requests_per_minute: limit("requests_per_minute")?,
                max_concurrent: limit("max_concurrent")?,
                max_queued: limit("max_queued")?,
                share: limit("share")?,
            },
            expires_at: row.try_get("expires_at")?,
            previous_hash: row.try_get("previous_key_hash")?,
            previous_expires_at: row.try_get("previous_expires_at")?,
        })
    }
}

impl<'r, R> sqlx::FromRow<'r, R> for RequestLogRow
where
    R: sqlx::Row,
    &'r str: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        let tokens = |column: &'r str| -> Result<Option<u64>, sqlx::Error> {
            convert_opt(row.try_get::<Option<i64>, _>(column)?, column)
        };
        let client_ip = row
            .try_get::<Option<String>, _>("client_ip")?
            .map(|ip| {
                ip.parse()
                    .map_err(|e: std::net::AddrParseError| sqlx::Error::ColumnDecode {
                        index: "client_ip".to_owned(),
                        source: e.into(),
                    })
            })
            .transpose()?;
        Ok(Self {
            request_id: row.try_get("request_id")?,
            created_at_ms: row.try_get("created_at_ms")?,
            key_id: row.try_get("key_id")?,
            key_prefix: row.try_get("key_prefix")?,
            email: row.try_get("email")?,
            client_ip,
            endpoint: row.try_get("endpoint")?,
            model: row.try_get("model")?,
            prompt_tokens: tokens("prompt_tokens")?,
            completion_tokens: tokens("completion_tokens")?,
            status: convert(row.try_get::<i32, _>("status")?, "status")?,
            error_code: row.try_get("error_code")?,
            latency_ms: convert(row.try_get::<i64, _>("latency_ms")?, "latency_ms")?,
            workload: row.try_get("workload")?,
            queue_wait_ms: row
                .try_get::<Option<i64>, _>("queue_wait_ms")?
                .map(|ms| convert(ms, "queue_wait_ms"))
                .transpose()?,
        })
    }
}

/// Maps a failed insert of `prefix` to [`StoreError::Duplicate`] when a unique
/// constraint refused it.
pub(super) fn insert_error(err: sqlx::Error, prefix: &str) -> StoreError {
    match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => {
            StoreError::Duplicate(prefix.to_owned())
        }
        _ => StoreError::Database(err),
    }
}

/// Now, in Unix milliseconds.
pub fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Now, in Unix seconds.
pub fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months() {
        for good in ["2026-01", "2026-12", "0000-09", "9999-10"] {
            assert!(is_month(good), "{good}");
        }
        for bad in [
            "2026-00",
            "2026-13",
            "2026-1",
            "2026-001",
            "202-01",
            "2026/01",
            "2026-0a",
            "",
            "２026-01",
        ] {
            assert!(!is_month(bad), "{bad}");
        }
    }

    #[test]
    fn limit_bounds() {
        assert_eq!(limit_column(Limit::RequestsPerMinute, 1).ok(), Some(1));
        assert!(limit_column(Limit::RequestsPerMinute, 0).is_err());
        assert!(limit_column(Limit::MaxConcurrent, 0).is_err());
        assert_eq!(limit_column(Limit::MaxQueued, 0).ok(), Some(0));
        assert_eq!(
            limit_column(Limit::MaxQueued, i32::MAX as u32).ok(),
            Some(i32::MAX)
        );
        match limit_column(Limit::MaxQueued, 3_000_000_000) {
            Err(StoreError::Invalid(message)) => assert_eq!(
                message,
                "max_queued must be between 0 and 2147483647 (got 3000000000)"
            ),
            other => panic!("expected Invalid, got {other:?}"),
        }
        assert_eq!(limit_column(Limit::Share, 1000).ok(), Some(1000));
        for refused in [0, 1001] {
            assert!(limit_column(Limit::Share, refused).is_err(), "{refused}");
        }
        assert_eq!(budget_column(i64::MAX as u64).ok(), Some(i64::MAX));
        assert!(budget_column(u64::MAX).is_err());
    }

    #[test]
    fn selectors() {
        assert!(matches!(
            KeySelector::parse("42"),
            KeySelector::Id(Some(42))
        ));
        assert!(matches!(
            KeySelector::parse("99999999999999999999999"),
            KeySelector::Id(None)
        ));
        assert!(matches!(
            KeySelector::parse("fg-AbCdEfGhI"),
            KeySelector::Prefix("fg-AbCdEfGhI")
        ));
        assert!(matches!(
            KeySelector::parse("-1"),
            KeySelector::Prefix("-1")
        ));
        assert!(matches!(KeySelector::parse(""), KeySelector::Prefix("")));
        for no_key in ["99999999999999999999999", "fg-\0", "\0", "1\0"] {
            assert!(KeySelector::parse(no_key).binds().is_none(), "{no_key:?}");
        }
        assert!(KeySelector::parse("fg-AbCdEfGhI").binds().is_some());
    }

    #[test]
    fn text_columns_hold_no_nul() {
        assert_eq!(text_column("name", "alice").ok(), Some("alice"));
        assert_eq!(text_column("name", "").ok(), Some(""));
        match text_column("email", "a\0@example.org") {
            Err(StoreError::Invalid(message)) => {
                assert_eq!(message, "email must not contain a NUL character (\\u0000)")
            }
            other => panic!("expected Invalid, got {other:?}"),
        }
    }
}
