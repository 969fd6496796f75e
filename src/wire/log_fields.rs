//! The fields of a text log line, written as tracing-subscriber's default formatter writes
//! them (`name=value`, strings quoted and escaped as `{:?}` does) but without its
//! formatting machinery for the common cases: a plain string (printable ASCII with
//! nothing to escape) is copied between quotes, an integer or a bool written directly, a
//! `Display` or `Debug` value formatted on its own (not inside the default formatter's
//! three-part `write!`). Everything else — the message, escapes, floats, errors, `r#`
//! names, and every field when the output has colours — goes to the default formatter
//! itself, so a line reads byte for byte the same either way.
//!
//! Why: the request log writes one line of ten fields per request, and formatting them
//! through `write!("{}{}{:?}")` per field was about 8 % of the gateway's instructions
//! per request (callgrind); the fields of the request span are formatted the same way
//! once per request.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{RecordFields, VisitOutput as _};
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::{DefaultVisitor, Writer};

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
    use crate::wire::log_line::LineFormat;

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
        assert_eq!(line, expected, "the whole line (crate::wire::log_line)");
    }
}
