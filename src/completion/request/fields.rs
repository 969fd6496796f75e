//! The accepted fields and the type-and-bound rule of each one.

use serde_json::value::RawValue;

use super::raw::{self, IntLiteral, Kind};
use crate::contract::{LOGPROBS_LIMIT, MAX_TOKENS_LIMIT};
use crate::error::ApiError;

/// Every field the request body may carry, in the order `docs/api.md` and the OpenAPI
/// document list them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Field {
    Model,
    Prompt,
    MaxTokens,
    N,
    Stop,
    Temperature,
    TopP,
    TopK,
    MinP,
    PresencePenalty,
    FrequencyPenalty,
    RepetitionPenalty,
    Seed,
    Logprobs,
    PromptLogprobs,
    Echo,
    Stream,
    StreamOptions,
    User,
    AddSpecialTokens,
}

impl Field {
    const ALL: [Field; 20] = [
        Field::Model,
        Field::Prompt,
        Field::MaxTokens,
        Field::N,
        Field::Stop,
        Field::Temperature,
        Field::TopP,
        Field::TopK,
        Field::MinP,
        Field::PresencePenalty,
        Field::FrequencyPenalty,
        Field::RepetitionPenalty,
        Field::Seed,
        Field::Logprobs,
        Field::PromptLogprobs,
        Field::Echo,
        Field::Stream,
        Field::StreamOptions,
        Field::User,
        Field::AddSpecialTokens,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Field::Model => "model",
            Field::Prompt => "prompt",
            Field::MaxTokens => "max_tokens",
            Field::N => "n",
            Field::Stop => "stop",
            Field::Temperature => "temperature",
            Field::TopP => "top_p",
            Field::TopK => "top_k",
            Field::MinP => "min_p",
            Field::PresencePenalty => "presence_penalty",
            Field::FrequencyPenalty => "frequency_penalty",
            Field::RepetitionPenalty => "repetition_penalty",
            Field::Seed => "seed",
            Field::Logprobs => "logprobs",
            Field::PromptLogprobs => "prompt_logprobs",
            Field::Echo => "echo",
            Field::Stream => "stream",
            Field::StreamOptions => "stream_options",
            Field::User => "user",
            Field::AddSpecialTokens => "add_special_tokens",
        }
    }

    pub(super) fn from_name(name: &str) -> Option<Field> {
        Field::ALL.into_iter().find(|f| f.name() == name)
    }
}

pub(super) fn unknown_field(name: &str) -> ApiError {
    let param: String = name.chars().take(64).collect();
    ApiError::invalid_param(param, format!("Unknown field '{}'", shown_key(name)))
}

/// A client-sent key as shown in a message: escaped like a JSON string and cut short.
pub(super) fn shown_key(name: &str) -> String {
    let escaped = serde_json::Value::String(name.to_owned()).to_string();
    let inner = escaped
        .get(1..escaped.len().saturating_sub(1))
        .unwrap_or_default();
    match inner.char_indices().nth(64) {
        Some((cut, _)) => format!("{}…", &inner[..cut]),
        None => inner.to_owned(),
    }
}

// ---------------------------------------------------------------------------------
// Integers

/// The accepted range of an integer field.
pub(super) struct IntRule {
    pub min: i64,
    pub max: i64,
    /// A value below `min` that is accepted too, with its meaning (`top_k: -1`).
    pub sentinel: Option<(i64, &'static str)>,
}

impl IntRule {
    const fn range(min: i64, max: i64) -> Self {
        Self {
            min,
            max,
            sentinel: None,
        }
    }

    fn describe(&self) -> String {
        let range = format!("between {} and {}", self.min, self.max);
        match self.sentinel {
            Some((value, meaning)) => format!("{value} ({meaning}) or {range}"),
            None => range,
        }
    }

    fn accepts(&self, v: i64) -> bool {
        (self.min..=self.max).contains(&v) || self.sentinel.is_some_and(|(s, _)| s == v)
    }
}

pub(super) const MAX_TOKENS: IntRule = IntRule::range(1, MAX_TOKENS_LIMIT as i64);
pub(super) const N: IntRule = IntRule::range(1, 16);
pub(super) const SEED: IntRule = IntRule::range(0, i64::MAX);
pub(super) const TOP_K: IntRule = IntRule {
    min: 1,
    max: i64::MAX,
    sentinel: Some((-1, "disabled")),
};
pub(super) const LOGPROBS: IntRule = IntRule::range(0, LOGPROBS_LIMIT as i64);
pub(super) const PROMPT_LOGPROBS: IntRule = IntRule {
    min: 0,
    max: 100,
    sentinel: Some((-1, "full vocabulary")),
};

/// A JSON integer literal within `rule`. Booleans, strings and numbers written with a
/// fraction or exponent are "must be an integer"; a literal outside the range (also one
/// too large for any integer type) is a bound error.
pub(super) fn int(field: Field, raw: &RawValue, rule: &IntRule) -> Result<i64, ApiError> {
    let name = field.name();
    match raw::int_literal(raw) {
        None => Err(ApiError::invalid_param(
            name,
            format!("{name} must be an integer (got {})", raw::render(raw)),
        )),
        Some(IntLiteral::Value(v)) if rule.accepts(v) => Ok(v),
        Some(_) if field == Field::MaxTokens && raw.get() == "0" => Err(max_tokens_zero()),
        Some(_) => Err(ApiError::invalid_param(
            name,
            format!(
                "{name} must be {} (got {})",
                rule.describe(),
                raw::render(raw)
            ),
        )),
    }
}

fn max_tokens_zero() -> ApiError {
    ApiError::invalid_param(
        "max_tokens",
        "max_tokens must be between 1 and 1000000 (got 0): max_tokens=0 is not supported. \
         To score a prompt without generating, send prompt_logprobs with max_tokens=1 and \
         echo=true, and ignore the one generated token.",
    )
}

// ---------------------------------------------------------------------------------
// Floats

/// The accepted range of a float field: `min` is inclusive unless `min_exclusive`;
/// `max` is inclusive.
pub(super) struct FloatRule {
    pub min: f64,
    pub min_exclusive: bool,
    pub max: f64,
}

impl FloatRule {
    const fn closed(min: f64, max: f64) -> Self {
        Self {
            min,
            min_exclusive: false,
            max,
        }
    }

    const fn left_open(min: f64, max: f64) -> Self {
        Self {
            min,
            min_exclusive: true,
            max,
        }
    }

    fn describe(&self) -> String {
        if self.min_exclusive {
            format!("greater than {} and at most {}", self.min, self.max)
        } else {
            format!("between {} and {}", self.min, self.max)
        }
    }

    fn accepts(&self, v: f64) -> bool {
        let above_min = if self.min_exclusive {
            v > self.min
        } else {
            v >= self.min
        };
        above_min && v <= self.max
    }
}

pub(super) const TEMPERATURE: FloatRule = FloatRule::closed(0.0, 100.0);
pub(super) const TOP_P: FloatRule = FloatRule::left_open(0.0, 1.0);
pub(super) const MIN_P: FloatRule = FloatRule::closed(0.0, 1.0);
pub(super) const PENALTY: FloatRule = FloatRule::closed(-2.0, 2.0);
pub(super) const REPETITION_PENALTY: FloatRule = FloatRule::left_open(0.0, 2.0);

/// A JSON number (integer or float literal) within `rule`; booleans and strings are
/// "must be a number".
pub(super) fn float(field: Field, raw: &RawValue, rule: &FloatRule) -> Result<f64, ApiError> {
    let name = field.name();
    match raw::number(raw) {
        None => Err(ApiError::invalid_param(
            name,
            format!("{name} must be a number (got {})", raw::render(raw)),
        )),
        Some(v) if rule.accepts(v) => Ok(v),
        Some(_) => Err(ApiError::invalid_param(
            name,
            format!(
                "{name} must be {} (got {})",
                rule.describe(),
                raw::render(raw)
            ),
        )),
    }
}

// ---------------------------------------------------------------------------------
// Booleans and strings

/// Only `true` or `false`; `"true"`, `1` and friends are rejected.
pub(super) fn boolean(param: &'static str, raw: &RawValue) -> Result<bool, ApiError> {
    raw::boolean(raw).ok_or_else(|| {
        ApiError::invalid_param(
            param,
            format!("{param} must be a boolean (got {})", raw::render(raw)),
        )
    })
}

pub(super) fn string(field: Field, raw: &RawValue) -> Result<String, ApiError> {
    let name = field.name();
    raw::string(raw).ok_or_else(|| {
        let message = if raw::kind(raw) == Kind::String {
            not_unicode(name)
        } else {
            format!("{name} must be a string (got {})", raw::render(raw))
        };
        ApiError::invalid_param(name, message)
    })
}

/// The message for a JSON string that does not decode: only a lone UTF-16 surrogate
/// escape gets past the JSON parser so far.
fn not_unicode(name: &str) -> String {
    format!(
        "{name} must be valid Unicode text (a lone UTF-16 surrogate escape like \\ud800 is not)"
    )
}

/// `model`: a non-empty string.
pub(super) fn model(raw: &RawValue) -> Result<String, ApiError> {
    let model = string(Field::Model, raw)?;
    if model.is_empty() {
        return Err(ApiError::invalid_param(
            "model",
            "model must not be an empty string (omit it to use the default model)",
        ));
    }
    Ok(model)
}

/// The most entries `stop` may have.
pub(super) const MAX_STOP_ENTRIES: usize = 4;

/// `stop`: a non-empty string, or an array of at most four non-empty strings. Each is
/// decoded here, so one vLLM could not read (a lone UTF-16 surrogate escape such as
/// `"\ud800"`) is refused before it is sent.
pub(super) fn stop(raw: &RawValue) -> Result<(), ApiError> {
    let err = |message: String| ApiError::invalid_param("stop", message);
    let empty = || err("stop must not contain an empty string".to_owned());
    let text = |item: &RawValue, name: &str| match raw::string(item) {
        Some(text) if text.is_empty() => Err(empty()),
        Some(_) => Ok(()),
        None => Err(err(not_unicode(name))),
    };
    match raw::kind(raw) {
        Kind::String => text(raw, "stop"),
        Kind::Array => {
            let items = raw::array(raw).unwrap_or_default();
            if items.len() > MAX_STOP_ENTRIES {
                return Err(err(format!(
                    "stop must have at most {MAX_STOP_ENTRIES} entries (got {})",
                    items.len()
                )));
            }
            for (i, item) in items.iter().enumerate() {
                match raw::kind(item) {
                    Kind::String => text(item, &format!("stop[{i}]"))?,
                    _ => {
                        return Err(err(format!(
                            "stop[{i}] must be a string (got {})",
                            raw::render(item)
                        )));
                    }
                }
            }
            Ok(())
        }
        _ => Err(err(format!(
            "stop must be a string or an array of strings (got {})",
            raw::render(raw)
        ))),
    }
}

/// `stream_options`, validated. Returns the `include_usage` value vLLM will apply:
/// the client's value, or vLLM's default `true` when the key is absent.
pub(super) fn stream_options(raw: &RawValue) -> Result<bool, ApiError> {
    let param = "stream_options";
    if raw::kind(raw) != Kind::Object {
        return Err(ApiError::invalid_param(
            param,
            format!(
                "stream_options must be an object (got {})",
                raw::render(raw)
            ),
        ));
    }
    let entries = serde_json::from_str::<super::raw::Entries>(raw.get())
        .map_err(|err| ApiError::invalid_param(param, format!("stream_options: {err}")))?
        .0;
    let mut include_usage = None;
    let mut continuous_usage_stats = None;
    for (key, value) in &entries {
        let (slot, name) = match key.as_ref() {
            "include_usage" => (&mut include_usage, "stream_options.include_usage"),
            "continuous_usage_stats" => (
                &mut continuous_usage_stats,
                "stream_options.continuous_usage_stats",
            ),
            other => {
                return Err(ApiError::invalid_param(
                    param,
                    format!("Unknown field 'stream_options.{}'", shown_key(other)),
                ));
            }
        };
        if slot.is_some() {
            return Err(ApiError::invalid_param(
                param,
                format!("duplicate field '{name}'"),
            ));
        }
        *slot = Some(boolean(name, value)?);
    }
    Ok(include_usage.unwrap_or(true))
}
