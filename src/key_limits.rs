//! The one rule for a key's own limit values: each limit's bounds, and the check every
//! caller (the key service, and the store before it writes) goes through.
//!
//! The lower bounds are what admission needs (a rate or a concurrency of 0 would refuse
//! every request; a share of 0 would never be served while others wait). The upper
//! bounds are what the store can hold: the `u32` limits are `INTEGER` columns and the
//! budget a `BIGINT` column in PostgreSQL; the SQLite schema keeps the same bounds
//! (`CHECK … BETWEEN 1 AND 2147483647`, see `migrations/*/0002_limits_usage_log.sql`).
//! `share` alone has a bound of its own, [`MAX_SHARE`], which both schemas' `CHECK` keep
//! too (`migrations/*/0008_share.sql`).

use std::fmt;

/// A limit a key can set for itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Limit {
    /// Prompt + completion tokens per calendar month (UTC).
    MonthlyBudget,
    /// Request starts per minute.
    RequestsPerMinute,
    /// Requests running at once.
    MaxConcurrent,
    /// Requests waiting beyond the running ones.
    MaxQueued,
    /// The key's weight in its models' fleet queues.
    Share,
}

/// The largest value of a `u32` limit: PostgreSQL's `INTEGER`.
const INTEGER_MAX: u64 = i32::MAX as u64;
/// The largest monthly budget: PostgreSQL's `BIGINT`.
const BIGINT_MAX: u64 = i64::MAX as u64;
/// The largest share. A share weighs one key's tokens against another's while both have
/// work waiting for a node: at 1000 against 1 the small key already gets one token in
/// 1001, so a larger weight is as good as unbounded, and a bound far below `INTEGER`
/// keeps a typo (`10000000`) from passing unnoticed.
pub const MAX_SHARE: u64 = 1000;

impl Limit {
    pub const ALL: [Self; 5] = [
        Self::MonthlyBudget,
        Self::RequestsPerMinute,
        Self::MaxConcurrent,
        Self::MaxQueued,
        Self::Share,
    ];

    /// The limit's field name, as in the admin API's bodies and in
    /// [`crate::store::LimitOverrides`].
    pub fn name(self) -> &'static str {
        match self {
            Self::MonthlyBudget => "monthly_budget",
            Self::RequestsPerMinute => "requests_per_minute",
            Self::MaxConcurrent => "max_concurrent",
            Self::MaxQueued => "max_queued",
            Self::Share => "share",
        }
    }

    /// The smallest allowed value.
    pub fn min(self) -> u64 {
        match self {
            Self::MonthlyBudget | Self::MaxQueued => 0,
            Self::RequestsPerMinute | Self::MaxConcurrent | Self::Share => 1,
        }
    }

    /// The largest allowed value: what the store's column holds.
    pub fn max(self) -> u64 {
        match self {
            Self::MonthlyBudget => BIGINT_MAX,
            Self::RequestsPerMinute | Self::MaxConcurrent | Self::MaxQueued => INTEGER_MAX,
            Self::Share => MAX_SHARE,
        }
    }

    /// The check: `value` within [`Limit::min`]`..=`[`Limit::max`], as the type the caller
    /// keeps it in (`u32`, `u64`, or a column's `i32`/`i64`). A type too narrow for a
    /// value within bounds is refused the same way, so no value is ever truncated.
    pub fn check<T: TryFrom<i128>>(self, value: impl Into<i128>) -> Result<T, InvalidLimit> {
        let value = value.into();
        let within = (i128::from(self.min())..=i128::from(self.max())).contains(&value);
        match T::try_from(value) {
            Ok(checked) if within => Ok(checked),
            _ => Err(InvalidLimit {
                limit: self,
                got: LimitInput::Whole(value),
            }),
        }
    }

    /// [`Limit::check`] for a value as a caller read it: anything but a whole number is
    /// refused.
    pub fn check_input<T: TryFrom<i128>>(self, input: &LimitInput) -> Result<T, InvalidLimit> {
        match input {
            LimitInput::Whole(value) => self.check(*value),
            LimitInput::Other(_) => Err(InvalidLimit {
                limit: self,
                got: input.clone(),
            }),
        }
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A limit value as a caller read it, not yet checked: a whole number (of any size a
/// JSON body or a command line can carry), or something else, kept as its text for the
/// error message (`"ten"`, `1.5`, `true`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitInput {
    Whole(i128),
    Other(String),
}

impl From<u32> for LimitInput {
    fn from(value: u32) -> Self {
        Self::Whole(value.into())
    }
}

impl From<u64> for LimitInput {
    fn from(value: u64) -> Self {
        Self::Whole(value.into())
    }
}

impl fmt::Display for LimitInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Whole(value) => write!(f, "{value}"),
            Self::Other(text) => f.write_str(text),
        }
    }
}

/// A limit value out of its bounds, or not a whole number. Displays as
/// `max_queued must be between 0 and 2147483647 (got 3000000000)`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{limit} {}", self.requirement())]
pub struct InvalidLimit {
    limit: Limit,
    got: LimitInput,
}

impl InvalidLimit {
    /// The limit at fault.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// The value refused.
    pub fn got(&self) -> &LimitInput {
        &self.got
    }

    /// The message without the field name, for a caller that names the field its own way
    /// (a command-line flag): `must be between 0 and 2147483647 (got 3000000000)`.
    pub fn requirement(&self) -> String {
        let (min, max, got) = (self.limit.min(), self.limit.max(), &self.got);
        match got {
            LimitInput::Whole(_) => format!("must be between {min} and {max} (got {got})"),
            LimitInput::Other(_) => {
                format!("must be a whole number between {min} and {max} (got {got})")
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// (limit, smallest, largest): the whole table.
    const TABLE: [(Limit, i128, i128); 5] = [
        (Limit::MonthlyBudget, 0, i64::MAX as i128),
        (Limit::RequestsPerMinute, 1, i32::MAX as i128),
        (Limit::MaxConcurrent, 1, i32::MAX as i128),
        (Limit::MaxQueued, 0, i32::MAX as i128),
        (Limit::Share, 1, 1000),
    ];

    #[test]
    fn the_table() {
        assert_eq!(
            Limit::ALL.map(|l| l.name()),
            [
                "monthly_budget",
                "requests_per_minute",
                "max_concurrent",
                "max_queued",
                "share"
            ]
        );
        for (limit, min, max) in TABLE {
            assert_eq!(i128::from(limit.min()), min, "{limit}");
            assert_eq!(i128::from(limit.max()), max, "{limit}");
            // The edges are accepted, as the widest type and as the column's.
            assert_eq!(limit.check::<i128>(min), Ok(min), "{limit}");
            assert_eq!(limit.check::<i128>(max), Ok(max), "{limit}");
            assert_eq!(limit.check::<u64>(max), Ok(max as u64), "{limit}");
            assert_eq!(limit.check::<i64>(max), Ok(max as i64), "{limit}");
            // One past each edge is refused, naming the field and both bounds.
            for past in [min - 1, max + 1, i128::MIN, i128::MAX] {
                let err = limit.check::<i128>(past).unwrap_err();
                assert_eq!(err.limit(), limit);
                assert_eq!(err.got(), &LimitInput::Whole(past));
                assert_eq!(
                    err.to_string(),
                    format!(
                        "{} must be between {min} and {max} (got {past})",
                        limit.name()
                    )
                );
            }
        }
    }

    #[test]
    fn the_u32_limits_fit_their_columns() {
        for limit in [
            Limit::RequestsPerMinute,
            Limit::MaxConcurrent,
            Limit::MaxQueued,
        ] {
            assert_eq!(limit.check::<i32>(i32::MAX), Ok(i32::MAX));
            assert_eq!(limit.check::<u32>(i32::MAX as u32), Ok(i32::MAX as u32));
            assert!(limit.check::<i32>(u32::MAX).is_err());
        }
        assert_eq!(
            Limit::MonthlyBudget.check::<i64>(i64::MAX as u64),
            Ok(i64::MAX)
        );
        assert!(Limit::MonthlyBudget.check::<i64>(u64::MAX).is_err());
    }

    #[test]
    fn the_reported_case() {
        let err = Limit::MaxQueued
            .check::<u32>(3_000_000_000_u32)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "max_queued must be between 0 and 2147483647 (got 3000000000)"
        );
        assert_eq!(
            err.requirement(),
            "must be between 0 and 2147483647 (got 3000000000)"
        );
    }

    #[test]
    fn shares_are_1_to_1000() {
        assert_eq!(
            Limit::Share.check::<u32>(0_u32).unwrap_err().to_string(),
            "share must be between 1 and 1000 (got 0)"
        );
        assert_eq!(
            Limit::Share.check::<i32>(1001_u32).unwrap_err().to_string(),
            "share must be between 1 and 1000 (got 1001)"
        );
        assert_eq!(Limit::Share.check::<i32>(1000_u32), Ok(1000));
    }

    #[test]
    fn zero_rate_and_concurrency_are_refused() {
        for limit in [Limit::RequestsPerMinute, Limit::MaxConcurrent] {
            let err = limit.check::<u32>(0_u32).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("{limit} must be between 1 and 2147483647 (got 0)")
            );
        }
        assert_eq!(Limit::MaxQueued.check::<u32>(0_u32), Ok(0));
        assert_eq!(Limit::MonthlyBudget.check::<u64>(0_u64), Ok(0));
    }

    #[test]
    fn a_value_that_is_not_a_whole_number_is_refused() {
        for (limit, _, _) in TABLE {
            for text in ["\"ten\"", "1.5", "true", "[1]", "ten"] {
                let input = LimitInput::Other(text.to_owned());
                let err = limit.check_input::<u64>(&input).unwrap_err();
                assert_eq!(err.limit(), limit);
                assert!(
                    err.to_string().starts_with(&format!(
                        "{} must be a whole number between {} and {} (got {text})",
                        limit.name(),
                        limit.min(),
                        limit.max()
                    )),
                    "{err}"
                );
            }
            assert_eq!(
                limit.check_input::<u64>(&LimitInput::Whole(1)),
                Ok(1),
                "{limit}"
            );
            assert!(limit.check_input::<u64>(&LimitInput::Whole(-1)).is_err());
        }
    }
}
