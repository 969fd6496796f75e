//! The admission step of a completion: ask the key's limiter for a running slot and a
//! budget reservation, waiting in the key's queue when all slots are taken.

use std::time::Duration;

use crate::admission::redis::LAPSED_KEEP;
use crate::admission::{Admitted, Cost, Denial, Grant, KeyLimits, Month};
use crate::backoff::Backoff;
use crate::error::ApiError;
use crate::metrics::Refusal;
use crate::state::AppState;

/// Pause before the second attempt of [`give_back_unconfirmed`]; doubled after each
/// failed attempt, up to [`GIVE_BACK_MAX_PAUSE`].
const GIVE_BACK_FIRST_PAUSE: Duration = Duration::from_millis(250);
const GIVE_BACK_MAX_PAUSE: Duration = Duration::from_secs(4);

/// Admits `lease` (the request id) for `key`, waiting in line if needed. A client that
/// goes away while waiting leaves the queue.
pub async fn admit(
    state: &AppState,
    key: i64,
    limits: &KeyLimits,
    cost: &Cost,
    lease: &str,
) -> Result<Grant, ApiError> {
    let limiter = state.limiter();
    let outcome = match limiter.admit(key, limits, cost, lease).await {
        Ok(Admitted::Running(grant)) => Ok(grant),
        Ok(Admitted::Queued) => {
            let _queued = state.metrics().admission_queued();
            let mut place = QueuePlace {
                state,
                key,
                lease,
                waiting: true,
            };
            let turn = limiter.wait_turn(key, limits, cost, lease).await;
            place.waiting = false;
            turn
        }
        Err(denial) => Err(denial),
    };
    match outcome {
        Ok(grant) => Ok(grant),
        Err(denial) => {
            state.metrics().admission_refused(match denial {
                Denial::RateLimited { .. } => Refusal::RateLimited,
                Denial::QueueFull { .. } => Refusal::QueueFull,
                Denial::BudgetExceeded { .. } => Refusal::BudgetExceeded,
                Denial::Unavailable(_) => Refusal::Unavailable,
            });
            if matches!(denial, Denial::Unavailable(_)) {
                give_back_unconfirmed(state, key, lease);
            }
            Err(refusal(state, key, limits, denial).await)
        }
    }
}

/// A step that failed on a shared backend may still take effect there: a Redis that
/// answers too late (paused, busy, a slow network) runs the script all the same, and
/// gives a running slot or a queue place to a request that was already refused — held
/// until its lease lapses, while it blocks the key's real requests. So the refused lease
/// is given back in the background: it leaves the queue and finishes with nothing used
/// (both idempotent; no-ops for a lease that holds nothing). Attempts continue, further
/// and further apart, until the backend answers or a lease could no longer be alive.
/// In-process limiters (no lease renewal) never apply a step half-way: nothing to do.
fn give_back_unconfirmed(state: &AppState, key: i64, lease: &str) {
    let limiter = state.limiter_handle();
    let Some(renewal) = limiter.lease_renewal() else {
        return;
    };
    // A slot lives three renewal periods without renewal (the Redis limiter's TTL), and
    // its reservation is kept aside for LAPSED_KEEP more; `finish` clears it until then.
    let window = renewal * 3 + LAPSED_KEEP;
    let lease = lease.to_owned();
    // Not on the tracked tasks: shutdown need not wait for a backend that is away (the
    // leases lapse by themselves).
    tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let nothing = Grant {
            max_tokens: 0,
            reserved: 0,
            month: Month::now(),
        };
        let mut pauses = Backoff::new(GIVE_BACK_FIRST_PAUSE, GIVE_BACK_MAX_PAUSE).pauses();
        loop {
            let given_back = async {
                limiter.leave(key, &lease).await?;
                limiter.finish(key, &lease, &nothing, 0).await
            };
            let Err(err) = given_back.await else { return };
            let pause = pauses.next_pause();
            if started.elapsed() + pause > window {
                tracing::warn!(error = %err, request_id = %lease, "could not give back a refused admission; it lapses with its lease");
                return;
            }
            tokio::time::sleep(pause).await;
        }
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
        } => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let reset = u64::try_from(month.next_start_unix()).unwrap_or(u64::MAX);
            ApiError::BudgetExceeded {
                budget,
                used,
                reserved,
                needed,
                month: month.to_string(),
                retry_after: std::time::Duration::from_secs(reset.saturating_sub(now)),
            }
        }
        Denial::Unavailable(reason) => {
            tracing::error!(%reason, "admission backend unavailable; refusing requests");
            ApiError::AdmissionUnavailable
        }
    }
}

/// A place in a key's queue, given up if the waiting future is dropped (the client
/// disconnected while waiting).
struct QueuePlace<'a> {
    state: &'a AppState,
    key: i64,
    lease: &'a str,
    waiting: bool,
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        if !self.waiting {
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
