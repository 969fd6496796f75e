//! Calendar months in UTC, the period of a monthly budget.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use time::OffsetDateTime;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Month {
    pub year: i32,
    /// 1–12.
    pub month: u8,
}

impl Month {
    pub fn from_unix(secs: i64) -> Self {
        let at = OffsetDateTime::from_unix_timestamp(secs).unwrap_or(OffsetDateTime::UNIX_EPOCH);
        Self {
            year: at.year(),
            month: u8::from(at.month()),
        }
    }

    pub fn now() -> Self {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Self::from_unix(i64::try_from(secs).unwrap_or(i64::MAX))
    }

    /// Unix seconds of 00:00 UTC on the 1st of the next month, when the budget resets.
    pub fn next_start_unix(self) -> i64 {
        let (year, month) = if self.month == 12 {
            (self.year + 1, 1)
        } else {
            (self.year, self.month + 1)
        };
        time::Month::try_from(month)
            .ok()
            .and_then(|m| time::Date::from_calendar_date(year, m, 1).ok())
            .map(|d| d.midnight().assume_utc().unix_timestamp())
            .unwrap_or(i64::MAX)
    }
}

/// `YYYY-MM`, as stored in the ledger and used in counter names.
impl fmt::Display for Month {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:02}", self.year, self.month)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months_turn_at_midnight_utc_on_the_first() {
        // 2026-11-30T23:59:59Z and 2026-12-01T00:00:00Z
        assert_eq!(Month::from_unix(1_796_083_199).to_string(), "2026-11");
        assert_eq!(Month::from_unix(1_796_083_200).to_string(), "2026-12");
        assert_eq!(
            Month::from_unix(1_796_083_199).next_start_unix(),
            1_796_083_200
        );
        let december = Month {
            year: 2026,
            month: 12,
        };
        assert_eq!(december.next_start_unix(), 1_798_761_600); // 2027-01-01
    }
}
