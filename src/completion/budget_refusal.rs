//! `X-Acs-Budget-Clamp: refuse`: where the key's budget would clamp `max_tokens`, refuse
//! the request with `budget_exceeded` instead, saying what is left and what the request
//! needs. The Workbench and Loom send it on every run (a person who set 200 tokens
//! should not silently get 37); any client may.

use super::admit::budget_exceeded;
use crate::admission::{Cost, Grant, KeyLimits};
use crate::error::ApiError;
use crate::metrics::Refusal;
use crate::state::AppState;

/// What to do when the budget would clamp `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnBudgetClamp {
    /// Run with fewer tokens and say so in `X-Acs-Max-Tokens-Clamped` (the default).
    Clamp,
    /// Refuse with `budget_exceeded`.
    Refuse,
}

/// The refusal of a request whose `grant` was clamped, given back already: what the
/// budget has left beside other requests, and the worst case the request needs. When
/// the counters cannot say what is left now, `admission_unavailable` (503, retry).
pub async fn refusal(
    state: &AppState,
    key_id: i64,
    limits: &KeyLimits,
    cost: &Cost,
    grant: &Grant,
) -> ApiError {
    state.metrics().admission_refused(Refusal::BudgetExceeded);
    match state.limiter().usage(key_id, grant.month).await {
        Ok(usage) => budget_exceeded(limits.monthly_budget, usage, cost.worst_case(), grant.month),
        Err(_) => ApiError::AdmissionUnavailable,
    }
}
