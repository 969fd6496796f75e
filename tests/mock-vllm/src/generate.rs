//! Generating one choice: seeded sampling from the toy model, `max_tokens`, stop token
//! ids and stop strings with vLLM's semantics (finish/stop reasons).

use serde_json::Value;

use super::logprobs::StepLogprobs;
use super::model::{Rng, Sampling, ToyModel, mix};
use super::tokenizer::Tokenizer;

/// Seed used when the request has none, so unseeded output is deterministic too.
const DEFAULT_SEED: u64 = 0x0123_4567_89AB_CDEF;

/// The request's generation knobs.
#[derive(Clone, Debug)]
pub(crate) struct GenParams {
    pub sampling: Sampling,
    /// Requested maximum (capped per prompt at `max_model_len − P` by the caller).
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub include_stop_str: bool,
    /// `logprobs=k`: record each generated token's logprob and the top-k.
    pub logprobs: Option<u32>,
    pub seed: Option<i64>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum StopReason {
    None,
    Text(String),
    Token(u32),
}

impl StopReason {
    /// `stop_reason` on the wire: null, the stop string, or the stop token id.
    pub fn to_json(&self) -> Value {
        match self {
            Self::None => Value::Null,
            Self::Text(s) => Value::from(s.as_str()),
            Self::Token(id) => Value::from(*id),
        }
    }
}

/// One generated choice.
#[derive(Clone, Debug)]
pub(crate) struct Generated {
    pub ids: Vec<u32>,
    /// Decoded text of each generated token.
    pub pieces: Vec<String>,
    /// The output text: the pieces joined, cut at a stop string / stop token.
    pub text: String,
    pub finish_reason: &'static str,
    pub stop_reason: StopReason,
    /// One entry per generated token when `logprobs` was requested, else empty.
    pub logprobs: Vec<StepLogprobs>,
}

/// Generate choice `choice` (0..n) for `prompt`, at most `max_tokens` tokens.
pub(crate) fn generate(
    model: &ToyModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    choice: u32,
    max_tokens: u32,
    params: &GenParams,
) -> Generated {
    let base = params.seed.map_or(DEFAULT_SEED, |s| s as u64);
    let prompt_hash = prompt.iter().fold(base, |h, &id| mix(h, u64::from(id)));
    let mut rng = Rng::new(mix(prompt_hash, u64::from(choice)));
    let longest_stop = params.stop.iter().map(String::len).max().unwrap_or(0);
    let mut out = Generated {
        ids: Vec::new(),
        pieces: Vec::new(),
        text: String::new(),
        finish_reason: "length",
        stop_reason: StopReason::None,
        logprobs: Vec::new(),
    };
    // The model looks at the last two tokens only.
    let mut context: Vec<u32> = prompt.iter().rev().take(2).rev().copied().collect();
    while (out.ids.len() as u32) < max_tokens {
        let dist = model.dist(&context);
        let id = model.sample(&dist, &params.sampling, &mut rng);
        if let Some(k) = params.logprobs {
            out.logprobs
                .push(StepLogprobs::new(model, &dist, id, k as usize));
        }
        let piece = tokenizer.token_text(id);
        out.ids.push(id);
        context = vec![context.last().copied().unwrap_or(id), id];
        let generated = out.ids.len() as u32;

        if generated >= params.min_tokens && params.stop_token_ids.contains(&id) {
            if params.include_stop_str {
                out.text.push_str(&piece);
            }
            out.pieces.push(piece);
            out.finish_reason = "stop";
            out.stop_reason = StopReason::Token(id);
            break;
        }
        out.text.push_str(&piece);
        let new_len = piece.len();
        out.pieces.push(piece);
        if generated > params.min_tokens && longest_stop > 0 {
            // Like vLLM's detokenizer: search only where a match could involve the new text.
            let from = floor_char_boundary(
                &out.text,
                out.text.len().saturating_sub(new_len + longest_stop),
            );
            let hit = params
                .stop
                .iter()
                .find_map(|s| out.text[from..].find(s.as_str()).map(|pos| (from + pos, s)));
            if let Some((pos, stop)) = hit {
                let cut = if params.include_stop_str {
                    pos + stop.len()
                } else {
                    pos
                };
                out.text.truncate(cut);
                out.finish_reason = "stop";
                out.stop_reason = StopReason::Text(stop.clone());
                break;
            }
        }
    }
    out
}

/// The largest char boundary ≤ `i` (`str::floor_char_boundary` is newer than our MSRV).
pub(crate) fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
