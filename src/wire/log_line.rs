//! A text log line, written as tracing-subscriber's default (`Full`) format writes it —
//! `2026-12-04T12:45:30.034620Z  INFO span{fields}: target: message fields` — byte for
//! byte, but without its formatting machinery:
//!
//! - the line ([`LineFormat`]): the timestamp made from the clock's seconds by
//!   arithmetic, the level, span names and target copied in. Lines with colours (a
//!   terminal) and events that came from the `log` crate go to the default format itself;
//! - its fields ([`LineFields`], the event's and each span's), `name=value` with strings
//!   quoted and escaped as `{:?}` does, for the common cases: a plain string (printable
//!   ASCII with nothing to escape) is copied between quotes, an integer or a bool written
//!   directly, a `Display` or `Debug` value formatted on its own (not inside the default
//!   formatter's three-part `write!`). Everything else — the message, escapes, floats,
//!   errors, `r#` names, and every field when the output has colours — goes to the
//!   default formatter itself, so a line reads byte for byte the same either way.
//!
//! Why: the request log writes a line of ten fields per request. The default format
//! spent ~9,000 instructions on the line around the fields (`write!` per piece, the
//! timestamp through `Display`, an ANSI style painted around every name even with
//! colours off): 5 % of a request; formatting the fields through `write!("{}{}{:?}")`
//! per field was about 8 % of the gateway's instructions per request (callgrind). The
//! fields of the request span are formatted the same way once per request.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::field::{RecordFields, VisitOutput as _};
use tracing_subscriber::fmt::format::{DefaultVisitor, Format, Full, Writer};
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
    fn without_time() -> Self {
        Self {
            without_time: true,
            ..Self::default()
        }
    }
}

/// The text format's field formatter (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct LineFields;

impl<'writer> FormatFields<'writer> for LineFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = LineVisitor {
            writer,
            is_empty: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct LineVisitor<'a> {
    writer: Writer<'a>,
    /// Nothing written yet: the next field needs no separating space.
    is_empty: bool,
    result: fmt::Result,
}

impl LineVisitor<'_> {
    /// The field's name when it can be written the plain way: not the message, not an
    /// `r#` name, no colours. `None` also for the `log.` fields that the default
    /// formatter leaves out (they are metadata of events that came from `log`).
    fn plain_name(&self, field: &Field) -> Result<&'static str, Skip> {
        let name = field.name();
        if name.starts_with("log.") {
            return Err(Skip::Leave);
        }
        if name == "message" || name.starts_with("r#") || self.writer.has_ansi_escapes() {
            return Err(Skip::Delegate);
        }
        Ok(name)
    }

    /// Writes `name=` and then what `value` writes.
    fn write_plain(&mut self, name: &str, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_err() {
            return;
        }
        let writer = &mut self.writer;
        let padded = if self.is_empty {
            Ok(())
        } else {
            writer.write_char(' ')
        };
        self.is_empty = false;
        self.result = padded
            .and_then(|()| writer.write_str(name))
            .and_then(|()| writer.write_char('='))
            .and_then(|()| value(writer));
    }

    /// Lets the default formatter write the field, and takes its result.
    fn delegate(&mut self, record: impl FnOnce(&mut DefaultVisitor<'_>)) {
        if self.result.is_err() {
            return;
        }
        let mut default = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        record(&mut default);
        self.is_empty = false;
        self.result = default.finish();
    }

    fn integer(&mut self, field: &Field, value: impl itoa::Integer + fmt::Debug) {
        match self.plain_name(field) {
            Ok(name) => self.write_plain(name, |w| w.write_str(itoa::Buffer::new().format(value))),
            Err(Skip::Leave) => {}
            Err(Skip::Delegate) => self.delegate(|d| d.record_debug(field, &value)),
        }
    }
}

/// Why a field is not written the plain way.
enum Skip {
    /// The default formatter leaves it out too.
    Leave,
    /// The default formatter writes it.
    Delegate,
}

/// Whether `{:?}` writes `value` between quotes unchanged: printable ASCII, without `"`
/// or `\`, which it would escape.
fn needs_no_escape(value: &str) -> bool {
    value
        .bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
}

impl Visit for LineVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        match self.plain_name(field) {
            Ok(name) if needs_no_escape(value) => self.write_plain(name, |w| {
                w.write_char('"')?;
                w.write_str(value)?;
                w.write_char('"')
            }),
            Err(Skip::Leave) => {}
            _ => self.delegate(|d| d.record_str(field, value)),
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.integer(field, value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.integer(field, value);
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        match self.plain_name(field) {
            Ok(name) => {
                self.write_plain(name, |w| w.write_str(if value { "true" } else { "false" }))
            }
            Err(Skip::Leave) => {}
            Err(Skip::Delegate) => self.delegate(|d| d.record_bool(field, value)),
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.delegate(|d| d.record_error(field, value));
    }

    /// `Display` (`%`) and `Debug` (`?`) values: `name=` and what `{:?}` writes, as the
    /// default formatter writes a field that is not the message (the request span's
    /// method and path, the request line's id and endpoint).
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        match self.plain_name(field) {
            Ok(name) => self.write_plain(name, |w| write!(w, "{value:?}")),
            Err(Skip::Leave) => {}
            Err(Skip::Delegate) => self.delegate(|d| d.record_debug(field, value)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;
    use tracing_subscriber::prelude::*;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    #[derive(Debug)]
    struct Failed(&'static str);
    impl fmt::Display for Failed {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Failed {}

    /// Every kind of field the gateway logs, and the values that must not take the plain
    /// way, in events and in span fields (also recorded after the span opened).
    fn log_everything() {
        let span = tracing::info_span!(
            "request",
            method = %"POST",
            path = "/v1/completions",
            request_id = "0b7e…",
            status = tracing::field::Empty,
        );
        let _entered = span.enter();
        span.record("status", 429_u64);
        tracing::info!(
            request_id = %"abc-123",
            endpoint = "/v1/completions",
            key_prefix = "",
            model = "meta-llama/Llama-3.1-8B",
            status = 200_u64,
            error_code = "rate_limit_exceeded",
            prompt_tokens = 0_u64,
            completion_tokens = u64::MAX,
            latency_ms = 12_u64,
            workload = "eval \"quoted\" back\\slash",
            "request finished"
        );
        tracing::warn!(
            tab = "a\tb",
            quoted = "say \"hi\"",
            escape = "\u{1b}[31mred",
            unicode = "café ☕",
            tilde_and_space = " ~ ",
            negative = -42_i64,
            flag = true,
            other = false,
            ratio = 0.5_f64,
            r#type = "raw name",
            debug = ?vec![1, 2],
            shown = %"tab\there \u{1b}[0m \"q\"",
            error = &Failed("it broke") as &(dyn std::error::Error + 'static),
            "message with {} and \u{1b} escape",
            "args"
        );
        tracing::info!("just a message");
        let outer = tracing::debug_span!("outer", n = 1_u64);
        let _outer = outer.enter();
        let empty = tracing::error_span!("empty");
        let _empty = empty.enter();
        tracing::error!(code = "x", "nested");
        tracing::debug!("debug");
        tracing::trace!(target: "other::target", "trace");
    }

    /// What [`log_everything`] writes through `format`.
    fn lines_of(format: LineFormat) -> String {
        let lines = Captured::default();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::filter::LevelFilter::TRACE)
            .with(
                tracing_subscriber::fmt::layer()
                    .fmt_fields(LineFields)
                    .event_format(format)
                    .with_ansi(false)
                    .with_writer(lines.clone()),
            );
        tracing::subscriber::with_default(subscriber, log_everything);
        lines.text()
    }

    #[test]
    fn lines_read_exactly_as_the_default_formatter_writes_them() {
        let default = Captured::default();
        let plain = Captured::default();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::filter::LevelFilter::TRACE)
            .with(
                tracing_subscriber::fmt::layer()
                    .without_time()
                    .with_ansi(false)
                    .with_writer(default.clone()),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .fmt_fields(LineFields)
                    .without_time()
                    .with_ansi(false)
                    .with_writer(plain.clone()),
            );
        tracing::subscriber::with_default(subscriber, log_everything);
        // Apart: two layers with the same field formatter would share the spans' fields.
        let line = lines_of(LineFormat::without_time());
        let timed = lines_of(LineFormat::default());
        let expected = default.text();
        // With the time: `2026-12-04T12:45:30.034620Z ` before the same line.
        assert_eq!(timed.lines().count(), expected.lines().count(), "{timed}");
        for (timed, expected) in timed.lines().zip(expected.lines()) {
            let (stamp, rest) = timed.split_at(28);
            assert_eq!(rest, expected);
            let mut shape = stamp.bytes().zip("0000-00-00T00:00:00.000000Z ".bytes());
            assert!(
                shape.all(|(b, s)| if s == b'0' {
                    b.is_ascii_digit()
                } else {
                    b == s
                }),
                "{timed}"
            );
        }
        assert_eq!(expected.lines().count(), 6, "{expected}");
        assert!(expected.contains(r#"workload="eval \"quoted\" back\\slash""#));
        assert!(expected.contains("DEBUG request{"), "{expected}");
        assert_eq!(plain.text(), expected);
        assert_eq!(line, expected, "the whole line (LineFormat)");
    }

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
