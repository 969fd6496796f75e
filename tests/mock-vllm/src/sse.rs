//! The SSE stream of a completion: one choice per chunk, choices interleaved
//! round-robin, the last chunk of each choice carrying the finish reason, an optional
//! usage-only chunk, then `data: [DONE]`.

use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};

use super::body::{Meta, reported_completion_tokens};
use super::error::stream_error_event;
use super::generate::{Generated, floor_char_boundary};
use super::logprobs::{LogprobsJson, StepLogprobs, prompt_rows};
use super::model::ToyModel;
use super::request::{Plan, Prompt};
use super::tokenizer::Tokenizer;

const DONE: &str = "data: [DONE]\n\n";

/// One SSE event and how long to wait before sending it.
#[derive(Clone, Debug)]
pub(crate) struct Frame {
    pub delay: Duration,
    pub data: Bytes,
}

impl Frame {
    fn new(delay: Duration, data: impl Into<Bytes>) -> Self {
        Self {
            delay,
            data: data.into(),
        }
    }
}

/// One choice to stream.
pub(crate) struct StreamChoice<'a> {
    pub index: usize,
    pub prompt: &'a Prompt,
    pub generated: &'a Generated,
}

/// Timing of the stream.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pace {
    pub first: Duration,
    pub between: Duration,
}

pub(crate) struct StreamBuilder<'a> {
    pub meta: &'a Meta,
    pub plan: &'a Plan,
    pub tokenizer: &'a Tokenizer,
    pub model: &'a ToyModel,
    pub pace: Pace,
}

impl StreamBuilder<'_> {
    /// Every frame of the stream, `[DONE]` included.
    pub fn frames(&self, choices: &[StreamChoice]) -> Vec<Frame> {
        let per_choice: Vec<Vec<Value>> = choices.iter().map(|c| self.choice_chunks(c)).collect();
        let rounds = per_choice.iter().map(Vec::len).max().unwrap_or(0);
        let mut frames = Vec::new();
        for round in 0..rounds {
            let mut delay = if round == 0 {
                self.pace.first
            } else {
                self.pace.between
            };
            for chunks in &per_choice {
                if let Some(chunk) = chunks.get(round) {
                    frames.push(Frame::new(std::mem::take(&mut delay), data(chunk)));
                }
            }
        }
        if let Some(k) = self.plan.error_after {
            frames.truncate(k);
            let delay = if frames.is_empty() {
                self.pace.first
            } else {
                self.pace.between
            };
            frames.push(Frame::new(delay, stream_error_event("mock failure")));
        } else if self.plan.include_usage {
            let prompt_tokens: usize = self.plan.prompts.iter().map(|p| p.ids.len()).sum();
            let completion_tokens = reported_completion_tokens(
                self.plan,
                choices.iter().map(|c| c.generated.ids.len()).sum(),
            );
            // Serialised with exclude_none: no `prompt_tokens_details` key.
            let mut chunk = self.envelope(json!([]));
            chunk["usage"] = json!({
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens.saturating_add(completion_tokens),
                "completion_tokens": completion_tokens,
            });
            frames.push(Frame::new(Duration::ZERO, data(&chunk)));
        }
        frames.push(Frame::new(Duration::ZERO, DONE));
        frames
    }

    /// The frames of a request that fails on its first token (`max_tokens: null`).
    pub fn failing(&self, message: &str) -> Vec<Frame> {
        vec![
            Frame::new(self.pace.first, stream_error_event(message)),
            Frame::new(Duration::ZERO, DONE),
        ]
    }

    fn envelope(&self, choices: Value) -> Value {
        json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
            "usage": null,
        })
    }

    /// One chunk per generated token.
    fn choice_chunks(&self, choice: &StreamChoice) -> Vec<Value> {
        let plan = self.plan;
        let generated = choice.generated;
        let text = &generated.text;
        let holdback = plan
            .params
            .stop
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        let logprobs = plan.params.logprobs.map(|k| {
            let json = LogprobsJson {
                tokenizer: self.tokenizer,
                as_ids: plan.tokens_as_ids,
            };
            (json, k as usize)
        });
        let prompt_len = choice.prompt.ids.len();
        let last = generated.ids.len().saturating_sub(1);
        // Bytes of `text` sent, untruncated bytes generated, characters sent (text_offset).
        let (mut emitted, mut cumulative, mut sent_chars) = (0, 0, 0);
        let mut chunks = Vec::with_capacity(generated.ids.len());
        for (t, &id) in generated.ids.iter().enumerate() {
            let mut delta = String::new();
            if t == 0 && plan.echo && !plan.return_token_ids {
                delta.push_str(&choice.prompt.echo_text);
            }
            if !plan.discard_output {
                cumulative += generated.pieces[t].len();
                // Hold back what a stop string could still claim, like vLLM.
                let visible = if t == last {
                    text.len()
                } else {
                    cumulative.saturating_sub(holdback).min(text.len())
                };
                let visible = floor_char_boundary(text, visible);
                if visible > emitted {
                    delta.push_str(&text[emitted..visible]);
                    emitted = visible;
                }
            }
            let logprobs_value = match &logprobs {
                None => Value::Null,
                Some((json, k)) => {
                    let prompt_part = if t == 0 && plan.echo {
                        prompt_rows(self.model, &choice.prompt.ids, plan.echo_prompt_top(*k))
                    } else {
                        Vec::new()
                    };
                    let own: Option<(u32, &StepLogprobs)> =
                        (!plan.discard_output).then(|| (id, &generated.logprobs[t]));
                    let rows = choice
                        .prompt
                        .ids
                        .iter()
                        .zip(prompt_part.iter())
                        .map(|(&pid, step)| (pid, step.as_ref()))
                        .chain(own.map(|(id, step)| (id, Some(step))));
                    json.build(rows, sent_chars).0
                }
            };
            let finished = t == last;
            let usage = if plan.continuous_usage {
                json!({
                    "prompt_tokens": prompt_len,
                    "total_tokens": prompt_len + t + 1,
                    "completion_tokens": t + 1,
                    "prompt_tokens_details": null,
                })
            } else {
                Value::Null
            };
            let show_prompt_ids = t == 0 && (plan.return_token_ids || plan.echo);
            let mut chunk = self.envelope(json!([{
                "index": choice.index,
                "text": delta,
                "logprobs": logprobs_value,
                "finish_reason": if finished { json!(generated.finish_reason) } else { Value::Null },
                "stop_reason": if finished { generated.stop_reason.to_json() } else { Value::Null },
                "prompt_token_ids": if show_prompt_ids { json!(choice.prompt.ids) } else { Value::Null },
                "token_ids": if plan.return_token_ids { json!([id]) } else { Value::Null },
            }]));
            chunk["usage"] = usage;
            sent_chars += delta.chars().count();
            chunks.push(chunk);
        }
        chunks
    }
}

fn data(chunk: &Value) -> String {
    format!("data: {chunk}\n\n")
}
