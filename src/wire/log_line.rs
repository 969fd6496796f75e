//! A text log line, written as tracing-subscriber's default (`Full`) format writes it —
//! `2026-12-04T12:45:30.034620Z  INFO span{fields}: target: message fields` — but
//! without its formatting machinery: the timestamp made from the clock's seconds by
//! arithmetic, the level, span names and target copied in. Lines with colours (a
//! terminal) and events that came from the `log` crate go to the default format itself.
//!
//! Why: the request log writes a line per request, and the default format spent ~9,000
//! instructions on it (`write!` per piece, the timestamp through `Display`, an ANSI
//! style painted around every name even with colours off): 5 % of a request. The
//! fields after the target are [`crate::wire::log_fields`]'s.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{Format, Full, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The text format's event formatter (see the module docs).
#[derive(Debug, Default)]
pub struct LineFormat {
    /// What the default format does, for lines this one leaves to it.
    full: Format<Full>,
    /// Tests compare lines without their time.
    without_time: bool,
}

impl<S, N> FormatEvent<S, N> for LineFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        // `log` records are re-labelled by the default format (their own target and
        // level); a time outside years 0–9999 it writes its own way.
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .ok()
            .and_then(|since| timestamp(since.as_secs(), since.subsec_micros()));
        let (Some(stamp), false, false) =
            (stamp, writer.has_ansi_escapes(), meta.target() == "log")
        else {
            return if self.without_time {
                self.full
                    .clone()
                    .without_time()
                    .format_event(ctx, writer, event)
            } else {
                self.full.format_event(ctx, writer, event)
            };
        };
        if !self.without_time {
            // Only ASCII digits and separators.
            writer.write_str(std::str::from_utf8(&stamp).map_err(|_| fmt::Error)?)?;
            writer.write_char(' ')?;
        }
        writer.write_str(match *meta.level() {
            Level::TRACE => "TRACE ",
            Level::DEBUG => "DEBUG ",
            Level::INFO => " INFO ",
            Level::WARN => " WARN ",
            Level::ERROR => "ERROR ",
        })?;
        if let Some(scope) = ctx.event_scope() {
            let mut seen = false;
            for span in scope.from_root() {
                writer.write_str(span.metadata().name())?;
                seen = true;
                if let Some(fields) = span.extensions().get::<FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    writer.write_char('{')?;
                    writer.write_str(fields)?;
                    writer.write_char('}')?;
                }
                writer.write_char(':')?;
            }
            if seen {
                writer.write_char(' ')?;
            }
        }
        writer.write_str(meta.target())?;
        writer.write_str(": ")?;
        ctx.format_fields(writer.by_ref(), event)?;
        writer.write_char('\n')
    }
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ` for a time `secs` after the epoch (years up to 9999).
fn timestamp(secs: u64, micros: u32) -> Option<[u8; 27]> {
    let days = i64::try_from(secs / 86_400).ok()?;
    let (year, month, day) = civil_date(days);
    if year > 9999 {
        return None;
    }
    let of_day = secs % 86_400;
    let mut out = *b"0000-00-00T00:00:00.000000Z";
    let mut put = |at: usize, width: usize, mut value: u64| {
        for i in (at..at + width).rev() {
            out[i] = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    put(0, 4, year as u64);
    put(5, 2, u64::from(month));
    put(8, 2, u64::from(day));
    put(11, 2, of_day / 3600);
    put(14, 2, of_day / 60 % 60);
    put(17, 2, of_day % 60);
    put(20, 6, u64::from(micros));
    Some(out)
}

/// The proleptic Gregorian date `days` after 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_date(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
impl LineFormat {
    pub(crate) fn without_time() -> Self {
        Self {
            without_time: true,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_read_as_the_calendar_says() {
        // Every day from 1970 to past 2400 (leap years, centuries, 2000), at a time of
        // day that moves, and the last day of year 9999.
        for day in (0..160_000_u64).chain([2_932_896]) {
            let secs = day * 86_400 + (day * 7_919) % 86_400;
            let micros = (day * 104_729 % 1_000_000) as u32;
            let expected = time::OffsetDateTime::from_unix_timestamp(secs as i64).unwrap();
            let expected = format!(
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{micros:06}Z",
                expected.year(),
                u8::from(expected.month()),
                expected.day(),
                expected.hour(),
                expected.minute(),
                expected.second(),
            );
            let stamp = timestamp(secs, micros).unwrap();
            assert_eq!(std::str::from_utf8(&stamp).unwrap(), expected);
        }
        // Year 10000 is left to the default format.
        assert_eq!(timestamp(2_932_897 * 86_400, 0), None);
    }
}
