//! Planning a completion once the request is valid: the `max_tokens` it runs with
//! (injected when the client left it out), the full-vocabulary prompt-length rule, and
//! the prompt tokens its budget reservation counts. Token counts come from the upstream's
//! `/tokenize` only when a cheap upper bound (bytes + BOS for text, the length for token
//! ids) cannot settle a rule; otherwise the bound is used. Before the first count the
//! request must pass its key's rate and queue (the gate), so that one the limiter would
//! refuse does not cost the node's tokenizer.

use crate::admission::Cost;
use crate::completion::admit::Gate;
use crate::completion::request::{CompletionRequest, Prompt};
use crate::contract::{FULL_VOCAB_MAX_PROMPT_TOKENS, MAX_OUTPUT_WORK};
use crate::error::ApiError;
use crate::fleet::Node;
use crate::upstream::Served;
use crate::upstream::UpstreamClient;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// What the request may cost: prompt tokens (exact where counted, else the upper
    /// bound), fan-out and the `max_tokens` it runs with.
    pub cost: Cost,
    /// Whether `max_tokens` is the injected default rather than the client's.
    pub default_max_tokens: bool,
    /// The client's `max_tokens`, or the default before the request window cut it.
    pub requested_max_tokens: u64,
    /// Whether the request window cut the default `max_tokens`.
    pub deadline_clamped: bool,
}

pub struct Planner<'a> {
    pub client: &'a UpstreamClient,
    /// A node that is up, to count tokens; `None` while the model boots.
    pub upstream: Option<&'a Node>,
    pub served: &'a Served,
    /// For a non-streaming request, the tokens one sequence can decode within the
    /// request window, and the window.
    pub deadline: Option<DeadlineFit>,
    /// Passed before the first prompt is counted: a request its key's rate or queue
    /// would refuse costs the node's tokenizer nothing.
    pub gate: Option<Gate<'a>>,
}

/// What fits in the window of a non-streaming request.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineFit {
    pub tokens: u64,
    pub window_secs: u64,
}

impl DeadlineFit {
    /// `window × decode rate`, at least one token.
    pub fn new(window: std::time::Duration, tokens_per_second: f64) -> Self {
        let tokens = (window.as_secs_f64() * tokens_per_second).floor();
        Self {
            // Saturating float-to-int conversion; the config keeps both factors positive.
            tokens: (tokens as u64).max(1),
            window_secs: window.as_secs(),
        }
    }
}

#[derive(Debug)]
pub enum PlanError {
    /// The request cannot run as asked.
    Refused(ApiError),
    /// A token count is needed and no node of the model is up to count it.
    NoNodeToCount,
    /// The node counting the tokens was found dead (by the caller, which watches it).
    NodeLost,
}

impl From<ApiError> for PlanError {
    fn from(err: ApiError) -> Self {
        Self::Refused(err)
    }
}

impl Planner<'_> {
    pub async fn plan(&self, request: &CompletionRequest<'_>) -> Result<Plan, PlanError> {
        let counts = request.prompt().token_upper_bounds();
        let mut tokens = Tokens {
            exact: vec![!request.prompt().is_text(); counts.len()],
            counts,
            gated: false,
        };
        if request.prompt_logprobs() == Some(-1) {
            for index in 0..tokens.counts.len() {
                if tokens.counts[index] > FULL_VOCAB_MAX_PROMPT_TOKENS {
                    let count = self.count(request, &mut tokens, index).await?;
                    if count > FULL_VOCAB_MAX_PROMPT_TOKENS {
                        return Err(PlanError::Refused(ApiError::FullVocabPromptTooLong {
                            tokens: count,
                            limit: FULL_VOCAB_MAX_PROMPT_TOKENS,
                        }));
                    }
                }
            }
        }
        let (requested_max_tokens, default_max_tokens) = match request.max_tokens() {
            Some(max_tokens) => (max_tokens, false),
            // Validation guarantees a single prompt with n = 1 here.
            None => (self.default_max_tokens(request, &mut tokens).await?, true),
        };
        let mut max_tokens = requested_max_tokens;
        let mut deadline_clamped = false;
        if let Some(fit) = self.deadline.filter(|fit| max_tokens > fit.tokens) {
            if !default_max_tokens {
                return Err(PlanError::Refused(ApiError::DeadlineInfeasible {
                    max_tokens,
                    fit: fit.tokens,
                    window_secs: fit.window_secs,
                }));
            }
            max_tokens = fit.tokens;
            deadline_clamped = true;
        }
        Ok(Plan {
            requested_max_tokens,
            deadline_clamped,
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
    ) -> Result<u64, PlanError> {
        let context = self.served.max_model_len;
        if context.saturating_sub(tokens.counts[0]) >= MAX_OUTPUT_WORK {
            return Ok(MAX_OUTPUT_WORK);
        }
        let count = self.count(request, tokens, 0).await?;
        match context.checked_sub(count) {
            Some(room) if room >= 1 => Ok(room.min(MAX_OUTPUT_WORK)),
            _ => Err(PlanError::Refused(ApiError::invalid_param(
                "prompt",
                format!(
                    "The prompt is {count} tokens, which leaves no room to generate within the model's context of {context} tokens."
                ),
            ))),
        }
    }

    /// The exact token count of prompt `index`, asking the upstream's tokenizer for text.
    async fn count(
        &self,
        request: &CompletionRequest<'_>,
        tokens: &mut Tokens,
        index: usize,
    ) -> Result<u64, PlanError> {
        if tokens.exact[index] {
            return Ok(tokens.counts[index]);
        }
        let text = match request.prompt() {
            Prompt::Text(text) => text.as_str(),
            Prompt::TextBatch(texts) => texts[index].as_str(),
            Prompt::Tokens(_) | Prompt::TokenBatch(_) => return Ok(tokens.counts[index]),
        };
        let Some(upstream) = self.upstream else {
            return Err(PlanError::NoNodeToCount);
        };
        if !std::mem::replace(&mut tokens.gated, true)
            && let Some(gate) = &self.gate
        {
            gate.pass().await?;
        }
        let count = upstream
            .count_tokens(self.client, self.served, text, request.add_special_tokens())
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
    /// Whether the gate was passed (once a request).
    gated: bool,
}
