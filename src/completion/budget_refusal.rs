//! `X-Acs-Budget-Clamp: refuse`: where the key's budget would clamp `max_tokens`, refuse
//! the request with `budget_exceeded` instead, saying what is left and what the request
//! needs. The Workbench and Loom send it on every run (a person who set 200 tokens
//! should not silently get 37); any client may.

use axum::http::HeaderMap;

use super::admit::budget_exceeded;
use crate::admission::{Cost, Grant, KeyLimits};
use crate::contract::X_ACS_BUDGET_CLAMP;
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

impl OnBudgetClamp {
    /// From `X-Acs-Budget-Clamp` (`clamp` or `refuse`, case-insensitive; absent:
    /// `clamp`). Any other value is a 400: guessing could run a request the client
    /// asked to have refused.
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, ApiError> {
        let Some(value) = headers.get(X_ACS_BUDGET_CLAMP) else {
            return Ok(Self::Clamp);
        };
        match value.to_str().map(str::trim) {
            Ok(v) if v.eq_ignore_ascii_case("clamp") => Ok(Self::Clamp),
            Ok(v) if v.eq_ignore_ascii_case("refuse") => Ok(Self::Refuse),
            _ => Err(ApiError::invalid(
                "X-Acs-Budget-Clamp must be 'clamp' or 'refuse'.",
            )),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(X_ACS_BUDGET_CLAMP, value.parse().unwrap());
        headers
    }

    #[test]
    fn the_header_decides() {
        assert_eq!(
            OnBudgetClamp::from_headers(&HeaderMap::new()).ok(),
            Some(OnBudgetClamp::Clamp)
        );
        assert_eq!(
            OnBudgetClamp::from_headers(&with("refuse")).ok(),
            Some(OnBudgetClamp::Refuse)
        );
        assert_eq!(
            OnBudgetClamp::from_headers(&with(" Refuse ")).ok(),
            Some(OnBudgetClamp::Refuse)
        );
        assert_eq!(
            OnBudgetClamp::from_headers(&with("clamp")).ok(),
            Some(OnBudgetClamp::Clamp)
        );
        let err = OnBudgetClamp::from_headers(&with("never")).unwrap_err();
        assert_eq!(err.code(), "invalid_request");
    }
}
