//! The admission step of a completion: ask the key's limiter for a running slot and a
//! budget reservation, waiting in the key's queue when all slots are taken.

use crate::admission::{Admitted, Cost, Denial, Grant, KeyLimits};
use crate::app::AppState;
use crate::error::ApiError;

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
    let denied = |denial| refusal(state, key, limits, denial);
    match limiter.admit(key, limits, cost, lease).await {
        Ok(Admitted::Running(grant)) => Ok(grant),
        Ok(Admitted::Queued) => {
            let mut place = QueuePlace {
                state,
                key,
                lease,
                waiting: true,
            };
            let turn = limiter.wait_turn(key, limits, cost, lease).await;
            place.waiting = false;
            match turn {
                Ok(grant) => Ok(grant),
                Err(denial) => Err(denied(denial).await),
            }
        }
        Err(denial) => Err(denied(denial).await),
    }
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
