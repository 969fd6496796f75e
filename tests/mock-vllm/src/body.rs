//! The non-streaming `CompletionResponse` body: compact JSON, keys in vLLM
//! 0.10.2+ order, every null present. Produced as a sequence of chunks so that a
//! full-vocab `prompt_logprobs` list is generated while it is being sent.

use std::collections::VecDeque;

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::logprobs::PromptLogprobsWriter;
use super::request::Plan;

/// Fields shared by every response of one request.
#[derive(Clone, Debug)]
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// One choice: its keys up to `token_ids`, then `prompt_logprobs`, then `prompt_token_ids`.
pub(crate) struct ChoiceBody {
    /// `index`, `text`, `logprobs`, `finish_reason`, `stop_reason`, `token_ids`.
    pub head: Map<String, Value>,
    /// `None` renders `"prompt_logprobs":null`.
    pub prompt_logprobs: Option<PromptLogprobsWriter>,
    pub prompt_token_ids: Value,
}

enum Part {
    Bytes(Bytes),
    PromptLogprobs(PromptLogprobsWriter),
}

/// An iterator over the chunks of the body.
pub(crate) struct NonStreamBody {
    parts: VecDeque<Part>,
}

impl NonStreamBody {
    pub fn new(meta: &Meta, choices: Vec<ChoiceBody>, usage: Value) -> Self {
        let mut parts = VecDeque::new();
        let mut text = open_object(&json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
        }));
        text.push_str(",\"choices\":[");
        for (i, choice) in choices.into_iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(&open_object(&Value::Object(choice.head)));
            text.push_str(",\"prompt_logprobs\":");
            match choice.prompt_logprobs {
                Some(writer) => {
                    parts.push_back(Part::Bytes(Bytes::from(std::mem::take(&mut text))));
                    parts.push_back(Part::PromptLogprobs(writer));
                }
                None => text.push_str("null"),
            }
            text.push_str(&continue_object(
                &json!({"prompt_token_ids": choice.prompt_token_ids}),
            ));
        }
        text.push(']');
        text.push_str(&continue_object(&json!({
            "service_tier": null,
            "system_fingerprint": null,
            "usage": usage,
            "kv_transfer_params": null,
        })));
        parts.push_back(Part::Bytes(Bytes::from(text)));
        Self { parts }
    }

    /// The whole body in one buffer (for bodies known to be small).
    pub fn collect_all(self) -> Bytes {
        let mut out = Vec::new();
        for chunk in self {
            out.extend_from_slice(&chunk);
        }
        Bytes::from(out)
    }
}

impl Iterator for NonStreamBody {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        loop {
            match self.parts.front_mut()? {
                Part::Bytes(bytes) => {
                    let bytes = std::mem::take(bytes);
                    self.parts.pop_front();
                    return Some(bytes);
                }
                Part::PromptLogprobs(writer) => match writer.next_chunk() {
                    Some(chunk) => return Some(chunk),
                    None => {
                        self.parts.pop_front();
                    }
                },
            }
        }
    }
}

/// `{"a":1}` → `{"a":1` (more keys follow).
fn open_object(value: &Value) -> String {
    let mut s = value.to_string();
    s.pop();
    s
}

/// `{"a":1}` → `,"a":1}` (continues an object left open).
fn continue_object(value: &Value) -> String {
    let s = value.to_string();
    format!(",{}", &s[1..])
}

/// The completion tokens a usage object reports: those generated, or the
/// `AbsurdUsage` mode's `i64::MAX`.
pub(crate) fn reported_completion_tokens(plan: &Plan, generated: usize) -> usize {
    if plan.absurd_usage {
        usize::try_from(i64::MAX).unwrap_or(usize::MAX)
    } else {
        generated
    }
}
