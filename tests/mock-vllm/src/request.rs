//! `POST /v1/completions` request parsing and validation, in vLLM 0.11's order:
//! content type and JSON, `before` validators, lax field types, model, suffix, prompt
//! tokenisation and the context-length check, `SamplingParams` checks, engine checks.
//! Unknown fields are ignored, as vLLM does.

use axum::http::{HeaderMap, header};
use serde_json::{Map, Value};

use super::config::MockConfig;
use super::error::VllmError;
use super::generate::GenParams;
use super::lax::{Fields, lax_int, py_float, py_repr, truthy, value_error};
use super::model::Sampling;
use super::tokenizer::Tokenizer;

/// One prompt of the batch, tokenised.
#[derive(Clone, Debug)]
pub(crate) struct Prompt {
    pub ids: Vec<u32>,
    /// What `echo` prepends: the text as sent, or the decoded ids of a token prompt.
    pub echo_text: String,
}

/// A validated completion request.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub prompts: Vec<Prompt>,
    pub n: u32,
    pub echo: bool,
    /// `None` for an explicit `"max_tokens": null`, which reproduces vLLM's 500.
    pub max_tokens: Option<u32>,
    /// `echo` with `max_tokens: 0`: one token is generated, counted, and not shown.
    pub discard_output: bool,
    pub params: GenParams,
    /// Effective prompt logprobs (echo + logprobs implies them); −1 = the whole vocab.
    pub prompt_logprobs: Option<i64>,
    pub stream: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
    pub return_token_ids: bool,
    pub tokens_as_ids: bool,
    pub request_id: Option<String>,
    /// Set from [`FailureMode::StreamError`]: fail a stream after this many content chunks.
    pub error_after: Option<usize>,
    /// Report usage of `i64::MAX` completion tokens (the `AbsurdUsage` mode).
    pub absurd_usage: bool,
}

impl Plan {
    /// Entries per prompt position in echoed `logprobs`: the prompt logprobs' k (all of
    /// them for −1), capped at the `logprobs` k.
    pub fn echo_prompt_top(&self, k: usize) -> usize {
        match self.prompt_logprobs {
            Some(kp) if kp >= 0 => (kp as usize).min(k),
            _ => k,
        }
    }
}

/// The `prompt` field after type validation, before batching.
enum PromptField {
    Str(String),
    Strs(Vec<String>),
    Ids(Vec<i64>),
    IdLists(Vec<Vec<i64>>),
}

/// `validate_json_request` (content type) plus FastAPI's JSON body parsing.
pub(crate) fn json_body(headers: &HeaderMap, body: &[u8]) -> Result<Map<String, Value>, VllmError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if content_type.split(';').next().unwrap_or("") != "application/json" {
        return Err(VllmError::validation(
            " [\"Unsupported Media Type: Only 'application/json' is allowed\"]",
        ));
    }
    if body.is_empty() {
        return Err(VllmError::validation(
            "[{'type': 'missing', 'loc': ('body',), 'msg': 'Field required', 'input': None}]",
        ));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(VllmError::validation(format!(
            "[{{'type': 'model_attributes_type', 'loc': ('body',), 'msg': 'Input should be a valid dictionary or object to extract fields from', 'input': {}}}]",
            py_repr(&other)
        ))),
        Err(e) => Err(VllmError::validation(format!(
            "[{{'type': 'json_invalid', 'loc': ('body', {}), 'msg': 'JSON decode error', 'input': {{}}, 'ctx': {{'error': 'Expecting value'}}}}]",
            e.column().saturating_sub(1)
        ))),
    }
}

/// Parse and validate a completion request.
pub(crate) fn parse(
    config: &MockConfig,
    tokenizer: &Tokenizer,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Plan, VllmError> {
    let map = json_body(headers, body)?;
    before_validators(&map)?;

    let mut f = Fields::new(&map);
    let prompt = prompt_field(&mut f);
    let model = f.string("model");
    let echo = f.bool("echo", true).unwrap_or(false);
    let n = f.int("n", false).unwrap_or(1);
    let best_of = f.int("best_of", true);
    let frequency_penalty = f.float("frequency_penalty", true).unwrap_or(0.0);
    let presence_penalty = f.float("presence_penalty", true).unwrap_or(0.0);
    let repetition_penalty = f.float("repetition_penalty", true).unwrap_or(1.0);
    let temperature = f.float("temperature", true).unwrap_or(1.0);
    let top_p = f.float("top_p", true).unwrap_or(1.0);
    let top_k = f.int("top_k", true).unwrap_or(0);
    let min_p = f.float("min_p", true).unwrap_or(0.0);
    let logprobs = f.int("logprobs", true);
    let prompt_logprobs = f.int("prompt_logprobs", true);
    let max_tokens = match map.get("max_tokens") {
        Some(Value::Null) => None,
        _ => Some(f.int("max_tokens", true).unwrap_or(16)),
    };
    let min_tokens = f.int("min_tokens", false).unwrap_or(0);
    let seed = f.int("seed", true);
    let stop = string_list(&mut f, "stop");
    let stop_token_ids = int_list(&mut f, "stop_token_ids");
    let include_stop_str = f.bool("include_stop_str_in_output", false).unwrap_or(false);
    let stream = f.bool("stream", true).unwrap_or(false);
    let stream_options = stream_options(&mut f);
    let suffix = f.string("suffix");
    let add_special_tokens = f.bool("add_special_tokens", false).unwrap_or(true);
    let return_token_ids = f.bool("return_token_ids", true).unwrap_or(false);
    let tokens_as_ids = f.bool("return_tokens_as_token_ids", true).unwrap_or(false);
    let request_id = f.string("request_id");
    f.finish()?;
    let prompt = prompt.ok_or_else(|| VllmError::validation("[]"))?;

    // Serving layer.
    let served = config.served_model_name.as_str();
    if let Some(model) = model.as_deref().filter(|m| !m.is_empty() && *m != served) {
        return Err(VllmError::model_not_found(model));
    }
    if suffix.is_some() {
        return Err(VllmError::bad_request("suffix is not currently supported"));
    }
    let raw_prompts = batch(prompt, tokenizer, add_special_tokens)?;
    // 0.10.2+ renderer: P > M − K, printing M − K as the "maximum context length".
    let k = max_tokens.unwrap_or(0);
    let budget = i64::from(config.max_model_len) - k;
    if let Some((_, ids)) = raw_prompts
        .iter()
        .find(|(_, ids)| ids.len() as i64 > budget)
    {
        return Err(VllmError::bad_request(format!(
            "This model's maximum context length is {budget} tokens. However, your request has {} input tokens. Please reduce the length of the input messages.",
            ids.len()
        )));
    }

    // SamplingParams._verify_args.
    let bad = |msg: String| Err(VllmError::bad_request(msg));
    if n < 1 {
        return bad(format!("n must be at least 1, got {n}."));
    }
    for (name, value) in [
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
    ] {
        if !(-2.0..=2.0).contains(&value) {
            return bad(format!(
                "{name} must be in [-2, 2], got {}.",
                py_float(value)
            ));
        }
    }
    if repetition_penalty <= 0.0 {
        return bad(format!(
            "repetition_penalty must be greater than zero, got {}.",
            py_float(repetition_penalty)
        ));
    }
    if temperature < 0.0 {
        return bad(format!(
            "temperature must be non-negative, got {}.",
            py_float(temperature)
        ));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad(format!("top_p must be in (0, 1], got {}.", py_float(top_p)));
    }
    if top_k < -1 {
        return bad(format!(
            "top_k must be 0 (disable), or at least 1, got {top_k}."
        ));
    }
    if !(0.0..=1.0).contains(&min_p) {
        return bad(format!("min_p must be in [0, 1], got {}.", py_float(min_p)));
    }
    let discard_output = echo && max_tokens == Some(0);
    if let Some(k) = max_tokens.filter(|&k| k < 1 && !discard_output) {
        return bad(format!("max_tokens must be at least 1, got {k}."));
    }
    if min_tokens < 0 {
        return bad(format!(
            "min_tokens must be greater than or equal to 0, got {min_tokens}."
        ));
    }
    if let Some(k) = max_tokens.filter(|&k| min_tokens > k) {
        return bad(format!(
            "min_tokens must be less than or equal to max_tokens={k}, got {min_tokens}."
        ));
    }
    if stop.iter().any(String::is_empty) {
        return bad("stop cannot contain an empty string.".to_owned());
    }
    if n > 1 && temperature < 1e-5 {
        return bad(format!("n must be 1 when using greedy sampling, got {n}."));
    }

    // Engine (v1 processor) checks; 0.12 reports them before the stream starts.
    if best_of.is_some_and(|b| b > 1) {
        return bad("vLLM V1 does not yet support best_of.".to_owned());
    }
    let max_logprobs = i64::from(config.max_logprobs);
    if let Some(k) = logprobs.filter(|&k| k > max_logprobs) {
        return bad(format!(
            "Requested sample logprobs of {k}, which is greater than max allowed: {max_logprobs}"
        ));
    }
    if let Some(k) = prompt_logprobs.filter(|&k| k > max_logprobs) {
        return bad(format!(
            "Requested prompt logprobs of {k}, which is greater than max allowed: {max_logprobs}"
        ));
    }
    let vocab = i64::from(tokenizer.vocab_size());
    let mut prompts = Vec::with_capacity(raw_prompts.len());
    for (text, ids) in raw_prompts {
        if ids.is_empty() {
            return bad("The decoder prompt cannot be empty".to_owned());
        }
        // vLLM reports the largest id; a negative one is reported the same way.
        let worst = ids.iter().copied().find(|&id| id < 0);
        let worst = worst.unwrap_or_else(|| ids.iter().copied().max().unwrap_or(0));
        if worst < 0 || worst >= vocab {
            return bad(format!("Token id {worst} is out of vocabulary"));
        }
        let ids: Vec<u32> = ids
            .into_iter()
            .filter_map(|id| u32::try_from(id).ok())
            .collect();
        let echo_text = text.unwrap_or_else(|| tokenizer.decode(&ids));
        prompts.push(Prompt { ids, echo_text });
    }

    let (include_usage, continuous_usage) = match stream_options {
        Some((include, continuous)) if stream => (include, include && continuous),
        _ => (false, false),
    };
    let logprobs = logprobs.map(|k| k.clamp(0, max_logprobs) as u32);
    Ok(Plan {
        prompts,
        n: n as u32,
        echo,
        max_tokens: max_tokens.map(|k| k.max(0) as u32),
        discard_output,
        params: GenParams {
            sampling: Sampling {
                temperature,
                top_k,
                top_p,
                min_p,
            },
            max_tokens: max_tokens.map_or(0, |k| k.max(1) as u32),
            min_tokens: min_tokens as u32,
            stop,
            stop_token_ids: stop_token_ids
                .into_iter()
                .filter_map(|id| u32::try_from(id).ok())
                .collect(),
            include_stop_str,
            logprobs,
            seed,
        },
        prompt_logprobs: prompt_logprobs.or(if echo { logprobs.map(i64::from) } else { None }),
        stream,
        include_usage,
        continuous_usage,
        return_token_ids,
        tokens_as_ids,
        request_id,
        error_after: None,
        absurd_usage: false,
    })
}

/// vLLM's `mode="before"` model validators, which see the raw JSON (Python truthiness).
fn before_validators(map: &Map<String, Value>) -> Result<(), VllmError> {
    let input = Value::Object(map.clone());
    let prompt_empty = match map.get("prompt") {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        _ => false,
    };
    let embeds_empty = match map.get("prompt_embeds") {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    };
    if prompt_empty && embeds_empty {
        return Err(value_error(
            "Either prompt or prompt_embeds must be provided and non-empty.",
            &input,
        ));
    }
    let stream = truthy(map.get("stream"));
    if truthy(map.get("stream_options")) && !stream {
        return Err(value_error(
            "Stream options can only be defined when `stream=True`.",
            &input,
        ));
    }
    let number = |key: &str| match map.get(key) {
        Some(Value::Number(n)) => n.as_f64(),
        Some(Value::Bool(b)) => Some(f64::from(u8::from(*b))),
        _ => None,
    };
    if let Some(k) = number("prompt_logprobs") {
        if stream && (k > 0.0 || k == -1.0) {
            return Err(value_error(
                "`prompt_logprobs` are not available when `stream=True`.",
                &input,
            ));
        }
        if k < 0.0 && k != -1.0 {
            return Err(value_error(
                "`prompt_logprobs` must be a positive value or -1.",
                &input,
            ));
        }
    }
    if number("logprobs").is_some_and(|k| k < 0.0) {
        return Err(value_error("`logprobs` must be a positive value.", &input));
    }
    Ok(())
}

/// `prompt: str | list[str] | list[int] | list[list[int]]` (smart union, lax ints).
fn prompt_field(f: &mut Fields) -> Option<PromptField> {
    let value = f.raw("prompt")?;
    let parsed = match value {
        Value::String(s) => Some(PromptField::Str(s.clone())),
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_string) => {
            Some(PromptField::Strs(
                items
                    .iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect(),
            ))
        }
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_array) => items
            .iter()
            .map(|list| {
                list.as_array()
                    .and_then(|l| l.iter().map(|v| lax_int(v).ok()).collect())
            })
            .collect::<Option<Vec<Vec<i64>>>>()
            .map(PromptField::IdLists),
        Value::Array(items) => items
            .iter()
            .map(|v| lax_int(v).ok())
            .collect::<Option<Vec<i64>>>()
            .map(PromptField::Ids),
        _ => None,
    };
    if parsed.is_none() {
        f.fail(
            "prompt",
            "string_type",
            "Input should be a valid string",
            value,
        );
    }
    parsed
}

/// `parse_and_batch_prompt` plus tokenisation: `(text as sent, token ids)` per prompt.
type RawPrompt = (Option<String>, Vec<i64>);

fn batch(
    prompt: PromptField,
    tokenizer: &Tokenizer,
    add_special: bool,
) -> Result<Vec<RawPrompt>, VllmError> {
    let none = || VllmError::bad_request("please provide at least one prompt");
    let encode = |text: String| {
        let ids = tokenizer
            .encode(&text, add_special)
            .into_iter()
            .map(i64::from)
            .collect();
        (Some(text), ids)
    };
    Ok(match prompt {
        PromptField::Str(text) => vec![encode(text)],
        PromptField::Strs(texts) => texts.into_iter().map(encode).collect(),
        PromptField::Ids(ids) if ids.is_empty() => return Err(none()),
        PromptField::Ids(ids) => vec![(None, ids)],
        PromptField::IdLists(lists) if lists[0].is_empty() => return Err(none()),
        PromptField::IdLists(lists) => lists.into_iter().map(|ids| (None, ids)).collect(),
    })
}

/// `str | list[str] | null`, default empty.
fn string_list(f: &mut Fields, key: &str) -> Vec<String> {
    match f.raw(key) {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(value @ Value::Array(items)) => {
            let strings: Option<Vec<String>> = items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect();
            strings.unwrap_or_else(|| {
                f.fail(key, "string_type", "Input should be a valid string", value);
                Vec::new()
            })
        }
        Some(value) => {
            f.fail(key, "string_type", "Input should be a valid string", value);
            Vec::new()
        }
    }
}

/// `list[int] | null`, default empty.
fn int_list(f: &mut Fields, key: &str) -> Vec<i64> {
    let Some(value) = f.raw(key) else {
        return Vec::new();
    };
    let ints = value.as_array().and_then(|items| {
        items
            .iter()
            .map(|v| lax_int(v).ok())
            .collect::<Option<Vec<i64>>>()
    });
    ints.unwrap_or_else(|| {
        f.fail(key, "list_type", "Input should be a valid list", value);
        Vec::new()
    })
}

/// `stream_options`: `(include_usage, continuous_usage_stats)`; `include_usage` defaults to
/// true when the object is given, an explicit null disables it.
fn stream_options(f: &mut Fields) -> Option<(bool, bool)> {
    let value = f.raw("stream_options")?;
    let Some(options) = value.as_object() else {
        f.fail(
            "stream_options",
            "model_type",
            "Input should be a valid dictionary or instance of StreamOptions",
            value,
        );
        return None;
    };
    let mut inner = Fields::new(options);
    let include = match options.get("include_usage") {
        None => true,
        Some(_) => inner.bool("include_usage", true).unwrap_or(false),
    };
    let continuous = inner.bool("continuous_usage_stats", true).unwrap_or(false);
    match inner.finish() {
        Ok(()) => Some((include, continuous)),
        Err(e) => {
            f.fail("stream_options", "model_type", e.message(), value);
            None
        }
    }
}
