//! Logprob data and its two wire shapes: `CompletionLogProbs` (four parallel arrays
//! keyed by decoded strings) and `prompt_logprobs` (keyed by token id, written
//! incrementally so a full-vocab body never sits whole in memory).

use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::model::{StepDist, ToyModel};
use super::tokenizer::Tokenizer;

/// vLLM clamps −inf to this so the JSON stays valid.
const MIN_LOGPROB: f64 = -9999.0;
/// Target size of one chunk of a streamed `prompt_logprobs` body.
const CHUNK_BYTES: usize = 64 * 1024;

/// The logprob of one chosen (sampled or prompt) token and the `k` likeliest tokens.
#[derive(Clone, Debug)]
pub(crate) struct StepLogprobs {
    pub logprob: f64,
    pub top: Vec<(u32, f64)>,
}

impl StepLogprobs {
    pub fn new(model: &ToyModel, dist: &StepDist, id: u32, k: usize) -> Self {
        Self {
            logprob: model.lookup(dist, id).0,
            top: model.top(dist, k),
        }
    }
}

/// Logprob rows for the prompt tokens (echo + logprobs): the first has none.
pub(crate) fn prompt_rows(model: &ToyModel, prompt: &[u32], k: usize) -> Vec<Option<StepLogprobs>> {
    (0..prompt.len())
        .map(|i| (i > 0).then(|| StepLogprobs::new(model, &model.dist(&prompt[..i]), prompt[i], k)))
        .collect()
}

/// Builds a `CompletionLogProbs` object from `(token id, logprobs)` rows.
pub(crate) struct LogprobsJson<'a> {
    pub tokenizer: &'a Tokenizer,
    /// `return_tokens_as_token_ids`: tokens become `"token_id:<id>"`.
    pub as_ids: bool,
}

impl LogprobsJson<'_> {
    fn token(&self, id: u32) -> String {
        if self.as_ids {
            format!("token_id:{id}")
        } else {
            self.tokenizer.token_text(id)
        }
    }

    /// `text_offset` starts at `offset` (Python characters already emitted) and grows by
    /// each token string's length. Returns the object and the offset after it.
    pub fn build<'s>(
        &self,
        rows: impl Iterator<Item = (u32, Option<&'s StepLogprobs>)>,
        mut offset: usize,
    ) -> (Value, usize) {
        let (mut offsets, mut logprobs, mut tokens, mut tops) = (vec![], vec![], vec![], vec![]);
        for (id, step) in rows {
            let token = self.token(id);
            offsets.push(offset);
            offset += token.chars().count();
            match step {
                None => {
                    logprobs.push(Value::Null);
                    tops.push(Value::Null);
                }
                Some(step) => {
                    logprobs.push(json!(step.logprob.max(MIN_LOGPROB)));
                    // The chosen token first, then the top-k; a repeated key keeps its
                    // first position (Python dict semantics), so k or k+1 entries.
                    let mut top = Map::new();
                    top.insert(token.clone(), json!(step.logprob.max(MIN_LOGPROB)));
                    for &(tid, lp) in &step.top {
                        top.insert(self.token(tid), json!(lp.max(MIN_LOGPROB)));
                    }
                    tops.push(Value::Object(top));
                }
            }
            tokens.push(token);
        }
        let object = json!({
            "text_offset": offsets,
            "token_logprobs": logprobs,
            "tokens": tokens,
            "top_logprobs": tops,
        });
        (object, offset)
    }
}

/// Writes a choice's `prompt_logprobs` list in chunks: `[null,{…},{…}]`, one object per
/// prompt position after the first, keyed by token id: the prompt token first (with its
/// true rank), then the top `k` (−1: the whole vocab) in rank order.
pub(crate) struct PromptLogprobsWriter {
    model: ToyModel,
    tokenizer: Tokenizer,
    prompt: Arc<Vec<u32>>,
    /// Entries per position besides the prompt token.
    limit: u32,
    /// Next prompt position; 0 = nothing written yet.
    pos: usize,
    /// The position being written: its distribution, prompt token and next rank.
    current: Option<(StepDist, u32, u32)>,
    done: bool,
    scratch: Vec<u8>,
}

impl PromptLogprobsWriter {
    pub fn new(model: ToyModel, tokenizer: Tokenizer, prompt: Arc<Vec<u32>>, k: i64) -> Self {
        let vocab = model.vocab_size();
        let limit = u32::try_from(k).map_or(vocab, |k| k.min(vocab));
        Self {
            model,
            tokenizer,
            prompt,
            limit,
            pos: 0,
            current: None,
            done: false,
            scratch: Vec::new(),
        }
    }

    /// The next chunk of JSON, or `None` once the closing `]` was written.
    pub fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut out = Vec::with_capacity(CHUNK_BYTES + 1024);
        while out.len() < CHUNK_BYTES {
            if let Some((dist, actual, rank)) = &mut self.current {
                while *rank < self.limit && out.len() < CHUNK_BYTES {
                    let (id, lp) = self.model.at_rank(dist, *rank);
                    *rank += 1;
                    if id != *actual {
                        out.push(b',');
                        write_entry(&mut out, &mut self.scratch, &self.tokenizer, id, lp, *rank);
                    }
                }
                if *rank >= self.limit {
                    out.push(b'}');
                    self.current = None;
                }
            } else if self.pos == 0 {
                out.extend_from_slice(b"[null");
                self.pos = 1;
            } else if self.pos < self.prompt.len() {
                let actual = self.prompt[self.pos];
                let dist = self.model.dist(&self.prompt[..self.pos]);
                let (lp, rank) = self.model.lookup(&dist, actual);
                out.extend_from_slice(b",{");
                write_entry(
                    &mut out,
                    &mut self.scratch,
                    &self.tokenizer,
                    actual,
                    lp,
                    rank,
                );
                self.current = Some((dist, actual, 0));
                self.pos += 1;
            } else {
                out.push(b']');
                self.done = true;
                break;
            }
        }
        Some(Bytes::from(out))
    }
}

/// `"<id>":{"logprob":…,"rank":…,"decoded_token":"…"}`
fn write_entry(
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
    tokenizer: &Tokenizer,
    id: u32,
    logprob: f64,
    rank: u32,
) {
    out.push(b'"');
    out.extend_from_slice(id.to_string().as_bytes());
    out.extend_from_slice(b"\":{\"logprob\":");
    push_json(out, &logprob.max(MIN_LOGPROB));
    out.extend_from_slice(b",\"rank\":");
    out.extend_from_slice(rank.to_string().as_bytes());
    out.extend_from_slice(b",\"decoded_token\":");
    scratch.clear();
    tokenizer.write_piece(id, scratch);
    push_json(out, &String::from_utf8_lossy(scratch));
    out.push(b'}');
}

fn push_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    // Serialising a float or a string into a Vec cannot fail.
    let _ = serde_json::to_writer(out, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_vocab_writer_is_valid_json() {
        let tokenizer = Tokenizer::new(50);
        let model = ToyModel::new(&tokenizer);
        let prompt = Arc::new(vec![1, 3, 9, 60 % 50]);
        let mut writer = PromptLogprobsWriter::new(model, tokenizer, prompt, -1);
        let mut body = Vec::new();
        while let Some(chunk) = writer.next_chunk() {
            body.extend_from_slice(&chunk);
        }
        let value: Value = serde_json::from_slice(&body).unwrap_or_default();
        let list = value.as_array().cloned().unwrap_or_default();
        assert_eq!(list.len(), 4);
        assert!(list[0].is_null());
        for entry in &list[1..] {
            assert_eq!(entry.as_object().map(Map::len), Some(50));
        }
        assert_eq!(
            list[2].as_object().and_then(|o| o.keys().next().cloned()),
            Some("9".to_owned())
        );
    }
}
