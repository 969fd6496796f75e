//! Planning a completion once the request is valid: the `max_tokens` to inject when the
//! client left it out, and the full-vocabulary prompt-length rule. Both need prompt
//! token counts; the upstream's `/tokenize` is asked only when a cheap upper bound
//! (bytes + BOS for text, the length for token ids) cannot settle the answer.

use crate::completion::request::{CompletionRequest, MAX_OUTPUT_WORK, Prompt};
use crate::error::ApiError;
use crate::fleet::{Served, Upstream};
use crate::upstream::UpstreamClient;

/// Longest prompt (in tokens) allowed with `prompt_logprobs: -1`.
pub const FULL_VOCAB_MAX_PROMPT_TOKENS: u64 = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// `max_tokens` to send when the client did not set it.
    pub injected_max_tokens: Option<u64>,
}

pub struct Planner<'a> {
    pub client: &'a UpstreamClient,
    pub upstream: &'a Upstream,
    pub served: &'a Served,
}

impl Planner<'_> {
    pub async fn plan(&self, request: &CompletionRequest<'_>) -> Result<Plan, ApiError> {
        let bounds = request.prompt().token_upper_bounds();
        if request.prompt_logprobs() == Some(-1) {
            for (index, &bound) in bounds.iter().enumerate() {
                if bound > FULL_VOCAB_MAX_PROMPT_TOKENS {
                    let tokens = self.exact_tokens(request, index, bound).await?;
                    if tokens > FULL_VOCAB_MAX_PROMPT_TOKENS {
                        return Err(ApiError::FullVocabPromptTooLong {
                            tokens,
                            limit: FULL_VOCAB_MAX_PROMPT_TOKENS,
                        });
                    }
                }
            }
        }
        let injected_max_tokens = match request.max_tokens() {
            Some(_) => None,
            // Validation guarantees a single prompt with n = 1 here.
            None => Some(self.default_max_tokens(request, bounds[0]).await?),
        };
        Ok(Plan {
            injected_max_tokens,
        })
    }

    /// `min(32000, max_model_len − prompt_tokens)`.
    async fn default_max_tokens(
        &self,
        request: &CompletionRequest<'_>,
        bound: u64,
    ) -> Result<u64, ApiError> {
        let context = self.served.max_model_len;
        if context.saturating_sub(bound) >= MAX_OUTPUT_WORK {
            return Ok(MAX_OUTPUT_WORK);
        }
        let tokens = self.exact_tokens(request, 0, bound).await?;
        match context.checked_sub(tokens) {
            Some(room) if room >= 1 => Ok(room.min(MAX_OUTPUT_WORK)),
            _ => Err(ApiError::invalid_param(
                "prompt",
                format!(
                    "The prompt is {tokens} tokens, which leaves no room to generate within the model's context of {context} tokens."
                ),
            )),
        }
    }

    /// The exact token count of prompt `index`: token-id prompts are their length (the
    /// bound), text is counted by the upstream's tokenizer.
    async fn exact_tokens(
        &self,
        request: &CompletionRequest<'_>,
        index: usize,
        bound: u64,
    ) -> Result<u64, ApiError> {
        let text = match request.prompt() {
            Prompt::Text(text) => text.as_str(),
            Prompt::TextBatch(texts) => texts[index].as_str(),
            Prompt::Tokens(_) | Prompt::TokenBatch(_) => return Ok(bound),
        };
        self.client
            .count_tokens(
                self.upstream,
                self.served,
                text,
                request.add_special_tokens(),
            )
            .await
    }
}
