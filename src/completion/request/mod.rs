//! Strict parsing of the `POST /v1/completions` request body, and the body sent upstream.
//!
//! Stricter than vLLM: no type coercion (`"16"`, `true`, `2.0` are not integers), unknown
//! fields and duplicate keys rejected, every bound of the public contract checked. Each
//! rejection is a 400 `invalid_request` whose message names the field, the bound and the
//! received value, and whose `param` is the field.
//!
//! The request borrows the body and keeps every field's raw JSON text, so the upstream
//! body is rebuilt without float or integer drift.

mod fields;
mod prompt;
mod raw;
#[cfg(test)]
mod tests;

use std::fmt;

use serde_json::value::RawValue;

use crate::contract::MAX_OUTPUT_WORK;
use crate::error::ApiError;
use fields::Field;
pub use prompt::Prompt;

/// A validated `/v1/completions` request. Borrows the body.
#[derive(Clone)]
pub struct CompletionRequest<'a> {
    /// The client's fields in the client's order, values as raw JSON text (nulls included).
    raw: Vec<(Field, &'a RawValue)>,
    model: Option<String>,
    prompt: Prompt,
    max_tokens: Option<u64>,
    n: u64,
    stream: bool,
    /// `Some` when `stream_options` is given (non-null): the `include_usage` vLLM applies.
    stream_include_usage: Option<bool>,
    logprobs: Option<u32>,
    prompt_logprobs: Option<i32>,
    add_special_tokens: bool,
    echo: bool,
}

/// Field names and typed settings only: the prompt and raw values are never shown.
impl fmt::Debug for CompletionRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys: Vec<&str> = self.raw.iter().map(|(field, _)| field.name()).collect();
        f.debug_struct("CompletionRequest")
            .field("keys", &keys)
            .field("model", &self.model)
            .field("prompt", &self.prompt)
            .field("max_tokens", &self.max_tokens)
            .field("n", &self.n)
            .field("stream", &self.stream)
            .field("include_usage", &self.include_usage())
            .field("logprobs", &self.logprobs)
            .field("prompt_logprobs", &self.prompt_logprobs)
            .field("add_special_tokens", &self.add_special_tokens)
            .field("echo", &self.echo)
            .finish()
    }
}

/// Typed fields as read, before the cross-field rules.
#[derive(Default)]
struct Parsed {
    model: Option<String>,
    prompt: Option<Prompt>,
    max_tokens: Option<u64>,
    n: Option<u64>,
    stream: Option<bool>,
    stream_include_usage: Option<bool>,
    logprobs: Option<u32>,
    prompt_logprobs: Option<i32>,
    add_special_tokens: Option<bool>,
    echo: Option<bool>,
}

impl<'a> CompletionRequest<'a> {
    /// Parses and validates a request body. Rules, in order: the body is a JSON object;
    /// every key is a known field, given once; each non-null value has its field's type
    /// and bound; then the cross-field rules (`Parsed::validate`).
    pub fn parse(body: &'a [u8]) -> Result<Self, ApiError> {
        let entries = raw::object_entries(body)?.0;

        let mut raw = Vec::with_capacity(entries.len());
        for (key, value) in entries {
            let field = Field::from_name(&key).ok_or_else(|| fields::unknown_field(&key))?;
            if raw.iter().any(|(seen, _)| *seen == field) {
                return Err(ApiError::invalid_param(
                    field.name(),
                    format!("duplicate field '{}'", field.name()),
                ));
            }
            raw.push((field, value));
        }

        let mut parsed = Parsed::default();
        for &(field, value) in &raw {
            if !raw::is_null(value) {
                parsed.read(field, value)?;
            }
        }
        parsed.validate(raw)
    }

    /// The requested model id; `None` when absent or null (the default model applies).
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    pub fn prompt(&self) -> &Prompt {
        &self.prompt
    }

    /// 1 for a single string or a single token list; the list length for a batch.
    pub fn prompt_count(&self) -> u64 {
        self.prompt.count()
    }

    /// The client's `max_tokens`; `None` when absent or null.
    pub fn max_tokens(&self) -> Option<u64> {
        self.max_tokens
    }

    /// Completions per prompt; default 1.
    pub fn n(&self) -> u64 {
        self.n
    }

    pub fn stream(&self) -> bool {
        self.stream
    }

    /// `stream_options.include_usage` as vLLM will apply it: `false` when
    /// `stream_options` is absent (or null), vLLM's default `true` when it is given
    /// without `include_usage` (e.g. `{}`), else the client's value.
    pub fn include_usage(&self) -> bool {
        self.stream_include_usage.unwrap_or(false)
    }

    pub fn logprobs(&self) -> Option<u32> {
        self.logprobs
    }

    /// `-1` is the full vocabulary.
    pub fn prompt_logprobs(&self) -> Option<i32> {
        self.prompt_logprobs
    }

    /// Default `true`.
    pub fn add_special_tokens(&self) -> bool {
        self.add_special_tokens
    }

    pub fn echo(&self) -> bool {
        self.echo
    }

    /// The model-dependent rule: `logprobs` ≤ the model's `max_logprobs`.
    pub fn check_logprobs_cap(&self, max_logprobs: u32) -> Result<(), ApiError> {
        match self.logprobs {
            Some(k) if k > max_logprobs => Err(ApiError::invalid_param(
                "logprobs",
                format!(
                    "logprobs must be at most {max_logprobs} for this model (got {k}); \
                     see capabilities.max_logprobs in GET /v1/models"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The body sent upstream: a compact JSON object with the client's keys in the
    /// client's order and each value's raw text byte for byte (insignificant whitespace
    /// removed), except:
    /// - `model` is set to `served_model` (inserted first when absent);
    /// - `max_tokens` is set to `injected_max_tokens` when `Some` (in place, also over a
    ///   null; appended last when absent);
    /// - keys whose value is `null` are dropped (vLLM fails on some explicit nulls:
    ///   `max_tokens: null` → 500, `n: null` → 400);
    /// - `prompt: ""` is sent as `[""]` (vLLM ≥ 0.10.2 rejects `""`, while `[""]`
    ///   tokenizes to BOS alone, as the contract promises for `""`);
    /// - a stream always asks for `stream_options.include_usage: true`, so it can be
    ///   metered (the relay drops the usage frame again when the client did not ask).
    pub fn upstream_body(&self, served_model: &str, injected_max_tokens: Option<u64>) -> Vec<u8> {
        let served_model = serde_json::Value::from(served_model).to_string();
        let capacity = self
            .raw
            .iter()
            .map(|(field, value)| field.name().len() + value.get().len() + 4)
            .sum::<usize>()
            + served_model.len()
            + 48;
        let mut out = Body::with_capacity(capacity);

        if !self.raw.iter().any(|(field, _)| *field == Field::Model) {
            out.entry(Field::Model, served_model.as_bytes());
        }
        let mut max_tokens_written = false;
        for &(field, value) in &self.raw {
            match (field, injected_max_tokens) {
                (Field::Model, _) => out.entry(field, served_model.as_bytes()),
                (Field::MaxTokens, Some(max_tokens)) => {
                    out.entry(field, max_tokens.to_string().as_bytes());
                    max_tokens_written = true;
                }
                _ if raw::is_null(value) => {}
                (Field::Prompt, _) if value.get() == r#""""# => out.entry(field, br#"[""]"#),
                (Field::StreamOptions, _) if self.stream => {
                    out.entry(field, &stream_options_with_usage(value));
                }
                _ => out.raw_entry(field, value.get()),
            }
        }
        if let (Some(max_tokens), false) = (injected_max_tokens, max_tokens_written) {
            out.entry(Field::MaxTokens, max_tokens.to_string().as_bytes());
        }
        let has_stream_options = self
            .raw
            .iter()
            .any(|(field, value)| *field == Field::StreamOptions && !raw::is_null(value));
        if self.stream && !has_stream_options {
            out.entry(Field::StreamOptions, br#"{"include_usage":true}"#);
        }
        out.finish()
    }
}

/// The client's `stream_options` with `include_usage` set to true, other keys kept.
fn stream_options_with_usage(value: &RawValue) -> Vec<u8> {
    let mut out = br#"{"include_usage":true"#.to_vec();
    // Validated in `parse`: an object whose keys are known stream options.
    if let Ok(entries) = raw::object_entries(value.get().as_bytes()) {
        for (key, value) in entries.0 {
            if key != "include_usage" {
                out.push(b',');
                out.extend_from_slice(serde_json::Value::from(key.as_ref()).to_string().as_bytes());
                out.push(b':');
                raw::push_compact(&mut out, value.get());
            }
        }
    }
    out.push(b'}');
    out
}

/// A compact JSON object under construction.
struct Body {
    out: Vec<u8>,
}

impl Body {
    fn with_capacity(capacity: usize) -> Self {
        let mut out = Vec::with_capacity(capacity);
        out.push(b'{');
        Self { out }
    }

    fn key(&mut self, field: Field) {
        if self.out.len() > 1 {
            self.out.push(b',');
        }
        // Field names are plain ASCII: no escaping needed.
        self.out.push(b'"');
        self.out.extend_from_slice(field.name().as_bytes());
        self.out.extend_from_slice(b"\":");
    }

    /// An entry whose value is already compact JSON.
    fn entry(&mut self, field: Field, value: &[u8]) {
        self.key(field);
        self.out.extend_from_slice(value);
    }

    /// An entry whose value is client text: copied with whitespace between tokens removed.
    fn raw_entry(&mut self, field: Field, value: &str) {
        self.key(field);
        raw::push_compact(&mut self.out, value);
    }

    fn finish(mut self) -> Vec<u8> {
        self.out.push(b'}');
        self.out
    }
}

impl Parsed {
    /// Reads one non-null field, checking its type and bound.
    fn read(&mut self, field: Field, value: &RawValue) -> Result<(), ApiError> {
        // Every bound below fits the target type, so these conversions cannot fail;
        // `unwrap_or_default` only keeps the lints quiet.
        match field {
            Field::Model => self.model = Some(fields::model(value)?),
            Field::Prompt => self.prompt = Some(prompt::parse(value)?),
            Field::MaxTokens => {
                let v = fields::int(field, value, &fields::MAX_TOKENS)?;
                self.max_tokens = Some(u64::try_from(v).unwrap_or_default());
            }
            Field::N => {
                let v = fields::int(field, value, &fields::N)?;
                self.n = Some(u64::try_from(v).unwrap_or_default());
            }
            Field::Seed => {
                fields::int(field, value, &fields::SEED)?;
            }
            Field::TopK => {
                fields::int(field, value, &fields::TOP_K)?;
            }
            Field::Logprobs => {
                let v = fields::int(field, value, &fields::LOGPROBS)?;
                self.logprobs = Some(u32::try_from(v).unwrap_or_default());
            }
            Field::PromptLogprobs => {
                let v = fields::int(field, value, &fields::PROMPT_LOGPROBS)?;
                self.prompt_logprobs = Some(i32::try_from(v).unwrap_or_default());
            }
            Field::Temperature => {
                fields::float(field, value, &fields::TEMPERATURE)?;
            }
            Field::TopP => {
                fields::float(field, value, &fields::TOP_P)?;
            }
            Field::MinP => {
                fields::float(field, value, &fields::MIN_P)?;
            }
            Field::PresencePenalty | Field::FrequencyPenalty => {
                fields::float(field, value, &fields::PENALTY)?;
            }
            Field::RepetitionPenalty => {
                fields::float(field, value, &fields::REPETITION_PENALTY)?;
            }
            Field::Echo => self.echo = Some(fields::boolean(field.name(), value)?),
            Field::Stream => self.stream = Some(fields::boolean(field.name(), value)?),
            Field::AddSpecialTokens => {
                self.add_special_tokens = Some(fields::boolean(field.name(), value)?);
            }
            Field::StreamOptions => {
                self.stream_include_usage = Some(fields::stream_options(value)?);
            }
            Field::Stop => fields::stop(value)?,
            Field::User => {
                fields::string(field, value)?;
            }
        }
        Ok(())
    }

    /// The cross-field rules, after every field has passed its own:
    /// 1. `prompt` is required (null counts as absent);
    /// 2. `stream_options` only with `stream: true`;
    /// 3. `prompt_logprobs` > 0 or -1 not with `stream: true` (0 is fine);
    /// 4. `max_tokens` required for a batch of prompts or `n` > 1;
    /// 5. `prompt_count × n × max_tokens` ≤ [`MAX_OUTPUT_WORK`].
    fn validate<'a>(
        self,
        raw: Vec<(Field, &'a RawValue)>,
    ) -> Result<CompletionRequest<'a>, ApiError> {
        let prompt = self
            .prompt
            .ok_or_else(|| ApiError::invalid_param("prompt", "prompt is required"))?;
        let stream = self.stream.unwrap_or(false);
        let n = self.n.unwrap_or(1);

        if self.stream_include_usage.is_some() && !stream {
            return Err(ApiError::invalid_param(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ));
        }
        match self.prompt_logprobs {
            Some(k) if stream && k != 0 => {
                return Err(ApiError::invalid_param(
                    "prompt_logprobs",
                    format!(
                        "prompt_logprobs must be 0 or omitted with stream: true (got {k}); \
                         top-k (> 0) and full-vocabulary (-1) prompt logprobs come back only \
                         in the non-streaming body"
                    ),
                ));
            }
            _ => {}
        }

        let prompt_count = prompt.count();
        match self.max_tokens {
            None if prompt_count > 1 || n > 1 => {
                return Err(ApiError::invalid_param(
                    "max_tokens",
                    "max_tokens is required when sending a batch of prompts or n > 1",
                ));
            }
            Some(max_tokens) => {
                let work = prompt_count.saturating_mul(n).saturating_mul(max_tokens);
                if work > MAX_OUTPUT_WORK {
                    return Err(ApiError::invalid_param(
                        "max_tokens",
                        format!(
                            "prompt_count × n × max_tokens = {prompt_count} × {n} × \
                             {max_tokens} = {work} exceeds the limit of {MAX_OUTPUT_WORK}"
                        ),
                    ));
                }
            }
            None => {}
        }

        Ok(CompletionRequest {
            raw,
            model: self.model,
            prompt,
            max_tokens: self.max_tokens,
            n,
            stream,
            stream_include_usage: self.stream_include_usage,
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
            add_special_tokens: self.add_special_tokens.unwrap_or(true),
            echo: self.echo.unwrap_or(false),
        })
    }
}
