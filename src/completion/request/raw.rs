//! JSON-level helpers: split an object into its ordered `(key, raw value)` entries,
//! classify a raw value, render a received value briefly for an error message, and
//! read numbers, booleans and strings from their raw text without any coercion.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::error::{ApiError, excerpt};

/// The entries of a JSON object in document order, keys decoded, values left as raw text.
/// Duplicate keys are kept (the caller decides what they mean).
pub(super) struct Entries<'a>(pub(super) Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for Entries<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;

        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries<'de>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(Key(key)) = map.next_key()? {
                    let value: &'de RawValue = map.next_value()?;
                    entries.push((key, value));
                }
                Ok(Entries(entries))
            }
        }

        deserializer.deserialize_map(EntriesVisitor)
    }
}

/// An object key: borrowed from the body unless it contains escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;

        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string key")
            }

            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Borrowed(v)))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }

        deserializer.deserialize_str(KeyVisitor)
    }
}

/// Splits a body that must be a JSON object into its entries. Malformed JSON gives
/// serde's message with its line and column; the body itself is never echoed.
pub(super) fn object_entries(body: &[u8]) -> Result<Entries<'_>, ApiError> {
    let first = body
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
    if first != Some(&b'{') {
        // Tell "not JSON at all" from "JSON, but not an object". `IgnoredAny` yields
        // only syntax errors, which never quote the input.
        return Err(match serde_json::from_slice::<de::IgnoredAny>(body) {
            Ok(_) => ApiError::invalid("request body must be a JSON object"),
            Err(err) => malformed(&err),
        });
    }
    // The top level is an object, so the only errors left are syntax errors.
    serde_json::from_slice::<Entries>(body).map_err(|err| malformed(&err))
}

fn malformed(err: &serde_json::Error) -> ApiError {
    ApiError::invalid(format!("request body is not valid JSON: {err}"))
}

/// The JSON type of a raw value, read from its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Null,
    Bool,
    Number,
    String,
    Array,
    Object,
}

pub(super) fn kind(raw: &RawValue) -> Kind {
    match raw.get().as_bytes().first() {
        Some(b'n') => Kind::Null,
        Some(b't' | b'f') => Kind::Bool,
        Some(b'"') => Kind::String,
        Some(b'[') => Kind::Array,
        Some(b'{') => Kind::Object,
        _ => Kind::Number,
    }
}

pub(super) fn is_null(raw: &RawValue) -> bool {
    kind(raw) == Kind::Null
}

/// A received value, briefly, for an error message: a number as written, a string
/// quoted and cut to ~40 characters, `true`/`false`/`null`, or "an array"/"an object".
pub(super) fn render(raw: &RawValue) -> String {
    let text = raw.get();
    match kind(raw) {
        Kind::Null | Kind::Bool => text.to_owned(),
        Kind::Number => excerpt(text),
        Kind::String => {
            let decoded: String = serde_json::from_str(text).unwrap_or_default();
            let shown = excerpt(&decoded);
            // Re-quote with JSON escaping so control characters stay visible.
            serde_json::Value::String(shown).to_string()
        }
        Kind::Array => "an array".to_owned(),
        Kind::Object => "an object".to_owned(),
    }
}

/// An integer literal as written: a JSON number without fraction or exponent.
pub(super) enum IntLiteral {
    /// Fits in an `i64`.
    Value(i64),
    /// A valid integer literal beyond the `i64` range.
    OutOfRange,
}

/// Reads a JSON integer literal (no fraction, no exponent). `None` when the value is
/// not a number or is written with a fraction or exponent (`2.0`, `1e3`).
pub(super) fn int_literal(raw: &RawValue) -> Option<IntLiteral> {
    if kind(raw) != Kind::Number {
        return None;
    }
    let text = raw.get();
    if text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
        return None;
    }
    // JSON guarantees `-?(0|[1-9][0-9]*)` here, so a parse failure is only overflow.
    Some(match text.parse::<i64>() {
        Ok(v) => IntLiteral::Value(v),
        Err(_) => IntLiteral::OutOfRange,
    })
}

/// Reads a JSON number (integer or float literal) as `f64`. `None` when not a number.
/// Literals beyond the `f64` range read as ±infinity, which every bound rejects.
pub(super) fn number(raw: &RawValue) -> Option<f64> {
    if kind(raw) != Kind::Number {
        return None;
    }
    raw.get().parse::<f64>().ok()
}

pub(super) fn boolean(raw: &RawValue) -> Option<bool> {
    match raw.get() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// Decodes a JSON string. `None` when the value is not a string.
pub(super) fn string(raw: &RawValue) -> Option<String> {
    if kind(raw) != Kind::String {
        return None;
    }
    serde_json::from_str(raw.get()).ok()
}

/// The elements of a JSON array as raw values. `None` when the value is not an array.
pub(super) fn array(raw: &RawValue) -> Option<Vec<&RawValue>> {
    if kind(raw) != Kind::Array {
        return None;
    }
    serde_json::from_str(raw.get()).ok()
}

/// Appends `raw` with insignificant whitespace removed; every token (numbers, strings
/// with their escapes, literals) is copied byte for byte.
pub(super) fn push_compact(out: &mut Vec<u8>, raw: &str) {
    let bytes = raw.as_bytes();
    if !bytes.iter().any(|b| is_ws(*b)) {
        out.extend_from_slice(bytes);
        return;
    }
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            out.push(b);
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if !is_ws(b) {
            if b == b'"' {
                in_string = true;
            }
            out.push(b);
        }
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}
