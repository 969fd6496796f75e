//! Planning a completion once the request is valid: the `max_tokens` it runs with
//! (injected when the client left it out), the full-vocabulary prompt-length rule, and
//! the prompt tokens its budget reservation counts. Token counts come from the upstream's
//! `/tokenize` only when a cheap upper bound (bytes + BOS for text, the length for token
//! ids) cannot settle a rule; otherwise the bound is used.

use crate::admission::Cost;
use crate::completion::request::{CompletionRequest, MAX_OUTPUT_WORK, Prompt};
use crate::error::ApiError;
use crate::fleet::{Served, Upstream};
use crate::upstream::UpstreamClient;

/// Longest prompt (in tokens) allowed with `prompt_logprobs: -1`.
pub const FULL_VOCAB_MAX_PROMPT_TOKENS: u64 = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// What the request may cost: prompt tokens (exact where counted, else the upper
    /// bound), fan-out and the `max_tokens` it runs with.
    pub cost: Cost,
    /// Whether `max_tokens` is the injected default rather than the client's.
    pub default_max_tokens: bool,
}

pub struct Planner<'a> {
    pub client: &'a UpstreamClient,
    pub upstream: &'a Upstream,
    pub served: &'a Served,
}

impl Planner<'_> {
    pub async fn plan(&self, request: &CompletionRequest<'_>) -> Result<Plan, ApiError> {
        let counts = request.prompt().token_upper_bounds();
        let mut tokens = Tokens {
            exact: vec![!request.prompt().is_text(); counts.len()],
            counts,
        };
        if request.prompt_logprobs() == Some(-1) {
            for index in 0..tokens.counts.len() {
                if tokens.counts[index] > FULL_VOCAB_MAX_PROMPT_TOKENS {
                    let count = self.count(request, &mut tokens, index).await?;
                    if count > FULL_VOCAB_MAX_PROMPT_TOKENS {
                        return Err(ApiError::FullVocabPromptTooLong {
                            tokens: count,
                            limit: FULL_VOCAB_MAX_PROMPT_TOKENS,
                        });
                    }
                }
            }
        }
        let (max_tokens, default_max_tokens) = match request.max_tokens() {
            Some(max_tokens) => (max_tokens, false),
            // Validation guarantees a single prompt with n = 1 here.
            None => (self.default_max_tokens(request, &mut tokens).await?, true),
        };
        Ok(Plan {
            cost: Cost {
                prompt_tokens: tokens.counts.iter().sum(),
                fan_out: request.prompt_count().saturating_mul(request.n()),
                max_tokens,
            },
            default_max_tokens,
        })
    }

    /// `min(32000, max_model_len − prompt_tokens)`.
    async fn default_max_tokens(
        &self,
        request: &CompletionRequest<'_>,
        tokens: &mut Tokens,
    ) -> Result<u64, ApiError> {
        let context = self.served.max_model_len;
        if context.saturating_sub(tokens.counts[0]) >= MAX_OUTPUT_WORK {
            return Ok(MAX_OUTPUT_WORK);
        }
        let count = self.count(request, tokens, 0).await?;
        match context.checked_sub(count) {
            Some(room) if room >= 1 => Ok(room.min(MAX_OUTPUT_WORK)),
            _ => Err(ApiError::invalid_param(
                "prompt",
                format!(
                    "The prompt is {count} tokens, which leaves no room to generate within the model's context of {context} tokens."
                ),
            )),
        }
    }

    /// The exact token count of prompt `index`, asking the upstream's tokenizer for text.
    async fn count(
        &self,
        request: &CompletionRequest<'_>,
        tokens: &mut Tokens,
        index: usize,
    ) -> Result<u64, ApiError> {
        if tokens.exact[index] {
            return Ok(tokens.counts[index]);
        }
        let text = match request.prompt() {
            Prompt::Text(text) => text.as_str(),
            Prompt::TextBatch(texts) => texts[index].as_str(),
            Prompt::Tokens(_) | Prompt::TokenBatch(_) => return Ok(tokens.counts[index]),
        };
        let count = self
            .client
            .count_tokens(
                self.upstream,
                self.served,
                text,
                request.add_special_tokens(),
            )
            .await?;
        tokens.counts[index] = count;
        tokens.exact[index] = true;
        Ok(count)
    }
}

/// Prompt token counts, one per prompt: exact for token ids, upper bounds for text
/// until counted.
struct Tokens {
    counts: Vec<u64>,
    exact: Vec<bool>,
}
