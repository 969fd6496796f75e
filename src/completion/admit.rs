//! The admission step of a completion: ask the key's limiter for a running slot and a
//! budget reservation, waiting in the key's queue when all slots are taken.

use std::time::Duration;

use crate::admission::{Admitted, Cost, Denial, Grant, KeyLimits, Month, Usage};
use crate::error::ApiError;
use crate::metrics::Refusal;
use crate::state::AppState;
use crate::store::now_unix;
use crate::throttled::Throttled;

/// While the backend is away every request is refused: one log line a second says so,
/// with how many there were since the last such line.
static UNAVAILABLE: Throttled = Throttled::new(Duration::from_secs(1));

/// Admits `lease` (the request id) for `key`, waiting in line if needed. A client that
/// goes away meanwhile gives back whatever the limiter may have given it ([`Asking`]).
pub async fn admit(
    state: &AppState,
    key: i64,
    limits: &KeyLimits,
    cost: &Cost,
    lease: &str,
) -> Result<Grant, ApiError> {
    let limiter = state.limiter();
    let mut asking = Asking::new(state, key, lease);
    let outcome = match limiter.admit(key, limits, cost, lease).await {
        Ok(Admitted::Running(grant)) => Ok(grant),
        Ok(Admitted::Queued) => {
            let _queued = state.metrics().admission_queued();
            asking.queued = true;
            limiter.wait_turn(key, limits, cost, lease).await
        }
        Err(denial) => Err(denial),
    };
    asking.answered = true;
    match outcome {
        Ok(grant) => Ok(grant),
        Err(denial) => Err(refused(state, key, limits, lease, denial).await),
    }
}

/// Whether `lease` would be admitted now, as [`admit`] would admit it, without keeping
/// what it takes: a running slot taken is given back at once, a queue place left (a
/// free place in the queue is an admission too). Refusals are [`admit`]'s; the rate
/// counts the start.
pub async fn check(
    state: &AppState,
    key: i64,
    limits: &KeyLimits,
    cost: &Cost,
    lease: &str,
) -> Result<(), ApiError> {
    let limiter = state.limiter();
    let mut asking = Asking::new(state, key, lease);
    let given_back = match limiter.admit(key, limits, cost, lease).await {
        Ok(Admitted::Running(grant)) => limiter.finish(key, lease, &grant, 0).await,
        Ok(Admitted::Queued) => {
            asking.queued = true;
            limiter.leave(key, lease).await
        }
        Err(denial) => {
            asking.answered = true;
            return Err(refused(state, key, limits, lease, denial).await);
        }
    };
    asking.answered = true;
    if let Err(err) = given_back {
        // The shared counters' leases expire: what could not be given back now comes
        // back then.
        tracing::warn!(error = %err, "could not give back a checked admission");
    }
    Ok(())
}

/// The key whose rate and queue a request must still pass, asked before anything that
/// costs the fleet is done for the request (counting its prompt's tokens).
#[derive(Clone, Copy)]
pub struct Gate<'a> {
    pub state: &'a AppState,
    pub key: i64,
    pub limits: &'a KeyLimits,
}

impl Gate<'_> {
    /// Refuses at once what [`admit`] would refuse on the key's rate or its full queue,
    /// taking nothing (see [`crate::admission::Limiter::peek`]). A backend that does not
    /// answer lets the request through: `admit` decides, and says so.
    pub async fn pass(&self) -> Result<(), ApiError> {
        match self.state.limiter().peek(self.key, self.limits).await {
            Ok(()) | Err(Denial::Unavailable(_)) => Ok(()),
            Err(denial) => {
                count_refusal(self.state, &denial);
                Err(refusal(self.state, self.key, self.limits, denial).await)
            }
        }
    }
}

/// Counts one start of a request that runs no completion against the key's rate, as
/// [`admit`] counts a completion's: over the rate, the same `rate_limited` refusal. No
/// slot, queue place or budget is taken.
pub async fn count_start(state: &AppState, key: i64, limits: &KeyLimits) -> Result<(), ApiError> {
    match state
        .limiter()
        .count_start(key, limits.requests_per_minute)
        .await
    {
        Ok(()) => Ok(()),
        Err(denial) => {
            count_refusal(state, &denial);
            Err(refusal(state, key, limits, denial).await)
        }
    }
}

/// Counts a refusal, and gives back what a shared backend may have applied unseen.
async fn refused(
    state: &AppState,
    key: i64,
    limits: &KeyLimits,
    lease: &str,
    denial: Denial,
) -> ApiError {
    count_refusal(state, &denial);
    if let (Denial::Unavailable(_), Some(give_back)) = (&denial, state.give_back()) {
        give_back.push(key, lease);
    }
    refusal(state, key, limits, denial).await
}

fn count_refusal(state: &AppState, denial: &Denial) {
    state.metrics().admission_refused(match denial {
        Denial::RateLimited { .. } => Refusal::RateLimited,
        Denial::QueueFull { .. } => Refusal::QueueFull,
        Denial::BudgetExceeded { .. } => Refusal::BudgetExceeded,
        Denial::Unavailable(_) => Refusal::Unavailable,
    });
}

/// The client-facing error for a refusal.
async fn refusal(state: &AppState, key: i64, limits: &KeyLimits, denial: Denial) -> ApiError {
    match denial {
        Denial::RateLimited { retry_after } => ApiError::RateLimited {
            rpm: limits.requests_per_minute,
            retry_after,
        },
        Denial::QueueFull { retry_after } => {
            let (running, queued) = state
                .limiter()
                .occupancy(key)
                .await
                .unwrap_or((limits.max_concurrent, limits.max_queued));
            ApiError::QueueFull {
                running,
                queued,
                retry_after,
            }
        }
        Denial::BudgetExceeded {
            budget,
            used,
            reserved,
            needed,
            month,
        } => budget_exceeded(budget, Usage { used, reserved }, needed, month),
        Denial::Unavailable(reason) => {
            if let Some(held) = UNAVAILABLE.note() {
                let refused = held + 1;
                tracing::error!(%reason, refused, "admission backend unavailable; refusing requests (count since the last such line)");
            }
            ApiError::AdmissionUnavailable
        }
    }
}

/// `budget_exceeded` for a request that needs `needed` tokens of a budget of which
/// `usage` is taken in `month`; retry after the month turns.
pub fn budget_exceeded(budget: u64, usage: Usage, needed: u64, month: Month) -> ApiError {
    let now = u64::try_from(now_unix()).unwrap_or(0);
    let reset = u64::try_from(month.next_start_unix()).unwrap_or(u64::MAX);
    ApiError::BudgetExceeded {
        budget,
        used: usage.used,
        reserved: usage.reserved,
        needed,
        month: month.to_string(),
        retry_after: Duration::from_secs(reset.saturating_sub(now)),
    }
}

/// An admission whose outcome the request does not have yet: from the first call to
/// the limiter until its answer is in hand. Dropped before that (the client went away,
/// and the request with it), what the limiter may have given it is given back. A
/// shared backend runs a call it has received whether or not anybody still waits for
/// the answer: the running slot it gave would be held until its lease lapsed, and the
/// slot's reservation counted against the key's budget for [`LAPSED_KEEP`] after; so
/// the lease is handed to the give-back task, which leaves the queue and finishes the
/// lease with nothing used (both idempotent). In process, a step is applied whole
/// before it answers, and only a queue place can be left behind.
///
/// [`LAPSED_KEEP`]: crate::admission::redis::LAPSED_KEEP
struct Asking<'a> {
    state: &'a AppState,
    key: i64,
    lease: &'a str,
    /// The lease is (or was) in the key's queue.
    queued: bool,
    /// The request has the outcome, and takes care of it from here.
    answered: bool,
}

impl<'a> Asking<'a> {
    fn new(state: &'a AppState, key: i64, lease: &'a str) -> Self {
        Self {
            state,
            key,
            lease,
            queued: false,
            answered: false,
        }
    }
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        if let Some(give_back) = self.state.give_back() {
            give_back.push(self.key, self.lease);
            return;
        }
        if !self.queued {
            return;
        }
        let limiter = self.state.limiter_handle();
        let (key, lease) = (self.key, self.lease.to_owned());
        self.state.tasks().spawn(async move {
            if let Err(err) = limiter.leave(key, &lease).await {
                tracing::warn!(error = %err, "could not leave the queue");
            }
        });
    }
}
