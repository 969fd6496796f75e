//! `prompt`: the four accepted forms, parsed strictly.

use std::fmt;

use serde_json::value::RawValue;

use super::raw::{self, IntLiteral, Kind};
use crate::error::ApiError;
use crate::fleet::PromptStart;

/// The prompt of a request, in one of the four forms the contract accepts.
#[derive(Clone, PartialEq, Eq)]
pub enum Prompt {
    /// One text prompt (may be empty: `""` tokenizes to BOS alone).
    Text(String),
    /// A batch of text prompts (`string[]`, at least one; entries may be empty).
    TextBatch(Vec<String>),
    /// One pre-tokenized prompt (`int[]`, at least one id).
    Tokens(Vec<u32>),
    /// A batch of pre-tokenized prompts (`int[][]`, at least one, none empty).
    TokenBatch(Vec<Vec<u32>>),
}

impl Prompt {
    /// Text (one string or a batch of them), as opposed to token ids.
    pub fn is_text(&self) -> bool {
        matches!(self, Self::Text(_) | Self::TextBatch(_))
    }

    /// How many prompts the request carries: 1 for a single string or a single token
    /// list, the list length for a batch.
    pub fn count(&self) -> u64 {
        let n = match self {
            Prompt::Text(_) | Prompt::Tokens(_) => 1,
            Prompt::TextBatch(texts) => texts.len(),
            Prompt::TokenBatch(batch) => batch.len(),
        };
        n as u64
    }

    /// The first prompt, which routes the request (a batch shares one node).
    pub fn start(&self) -> PromptStart<'_> {
        match self {
            Prompt::Text(s) => PromptStart::Text(s.as_bytes()),
            Prompt::TextBatch(texts) => {
                PromptStart::Text(texts.first().map_or(&[], |t| t.as_bytes()))
            }
            Prompt::Tokens(ids) => PromptStart::Tokens(ids),
            Prompt::TokenBatch(batch) => PromptStart::Tokens(batch.first().map_or(&[], |ids| ids)),
        }
    }

    /// An upper bound on each prompt's token count, without a tokenizer; one entry per
    /// prompt, in order.
    ///
    /// - Token-id prompts are exact: their length (ids are forwarded verbatim, no BOS).
    /// - Text is bounded by its UTF-8 byte length + 1: with a byte-level BPE tokenizer
    ///   (Llama-3, GPT-2 style) every token covers at least one byte, and
    ///   `add_special_tokens` adds at most one BOS. `""` gives 1 (BOS alone). The bound
    ///   assumes such a tokenizer: a SentencePiece tokenizer with a dummy-prefix space
    ///   (Llama-2, Mistral v1) can emit one more token, and a tokenizer that also
    ///   appends EOS would need +2.
    pub fn token_upper_bounds(&self) -> Vec<u64> {
        let text_bound = |s: &String| s.len() as u64 + 1;
        match self {
            Prompt::Text(s) => vec![text_bound(s)],
            Prompt::TextBatch(texts) => texts.iter().map(text_bound).collect(),
            Prompt::Tokens(ids) => vec![ids.len() as u64],
            Prompt::TokenBatch(batch) => batch.iter().map(|ids| ids.len() as u64).collect(),
        }
    }
}

/// Shows the form and sizes, never the text or the ids (prompts are not logged).
impl fmt::Debug for Prompt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Prompt::Text(s) => write!(f, "Text({} bytes)", s.len()),
            Prompt::TextBatch(t) => write!(f, "TextBatch({} prompts)", t.len()),
            Prompt::Tokens(ids) => write!(f, "Tokens({} ids)", ids.len()),
            Prompt::TokenBatch(b) => write!(f, "TokenBatch({} prompts)", b.len()),
        }
    }
}

const FORMS: &str = "a string, an array of strings, an array of token ids (integers) \
                     or an array of arrays of token ids";

fn invalid(message: String) -> ApiError {
    ApiError::invalid_param("prompt", message)
}

/// Parses a non-null `prompt`.
pub(super) fn parse(raw: &RawValue) -> Result<Prompt, ApiError> {
    match raw::kind(raw) {
        Kind::String => Ok(Prompt::Text(text(raw, "prompt")?)),
        Kind::Array => {
            let items = raw::array(raw).unwrap_or_default();
            let Some(first) = items.first() else {
                return Err(invalid(format!(
                    "prompt must not be an empty list; send {FORMS}"
                )));
            };
            match raw::kind(first) {
                Kind::String => text_batch(&items).map(Prompt::TextBatch),
                Kind::Number => token_ids(&items, "prompt").map(Prompt::Tokens),
                Kind::Array => token_batch(&items).map(Prompt::TokenBatch),
                _ => Err(invalid(format!(
                    "prompt must be {FORMS} (prompt[0] is {})",
                    raw::render(first)
                ))),
            }
        }
        _ => Err(invalid(format!(
            "prompt must be {FORMS} (got {})",
            raw::render(raw)
        ))),
    }
}

fn text(raw: &RawValue, at: &str) -> Result<String, ApiError> {
    raw::string(raw)
        .ok_or_else(|| invalid(format!("{at} must be a string (got {})", raw::render(raw))))
}

fn text_batch(items: &[&RawValue]) -> Result<Vec<String>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            raw::string(item).ok_or_else(|| {
                invalid(format!(
                    "prompt is an array of strings (a batch of text prompts), so prompt[{i}] \
                     must be a string too (got {})",
                    raw::render(item)
                ))
            })
        })
        .collect()
}

/// A non-empty list of token ids; `at` names the list in messages (`prompt`, `prompt[2]`).
fn token_ids(items: &[&RawValue], at: &str) -> Result<Vec<u32>, ApiError> {
    if items.is_empty() {
        return Err(invalid(format!(
            "{at} must not be an empty list of token ids"
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let id = match raw::int_literal(item) {
                Some(IntLiteral::Value(v)) => u32::try_from(v).ok(),
                _ => None,
            };
            id.ok_or_else(|| {
                let got = raw::render(item);
                invalid(if raw::kind(item) == Kind::Number {
                    format!("{at}[{i}] must be a token id, an integer between 0 and {} (got {got})", u32::MAX)
                } else {
                    format!("{at} is an array of token ids, so {at}[{i}] must be a token id (an integer) too (got {got})")
                })
            })
        })
        .collect()
}

fn token_batch(items: &[&RawValue]) -> Result<Vec<Vec<u32>>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let Some(ids) = raw::array(item) else {
                return Err(invalid(format!(
                    "prompt is an array of token-id arrays (a batch of pre-tokenized prompts), \
                     so prompt[{i}] must be an array of token ids too (got {})",
                    raw::render(item)
                )));
            };
            token_ids(&ids, &format!("prompt[{i}]"))
        })
        .collect()
}
