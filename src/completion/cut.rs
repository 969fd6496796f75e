//! When a request must stop short: fleetgate's shutdown grace period is over, or its
//! node was found dead. One that has not started by the end of the grace period gets
//! 503 ([`unless_draining`]); a relayed answer is cut ([`Cut`]): a streamed body looks
//! at this between the pieces it relays, and before it waits for the next.

use std::future::Future;
use std::pin::Pin;

use tokio_util::sync::CancellationToken;

use crate::error::ApiError;
use crate::state::AppState;

/// Runs `work` unless the shutdown grace period ends first (then 503).
pub(super) async fn unless_draining<T>(
    state: &AppState,
    work: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    tokio::select! {
        done = work => done,
        () = state.draining().cancelled() => Err(shutting_down()),
    }
}

/// 503: the shutdown grace period is over and the request had not started.
pub(super) fn shutting_down() -> ApiError {
    ApiError::UpstreamUnavailable("fleetgate is shutting down. Retry shortly.".into())
}

/// Resolves, with the reason, when a relayed body must be cut short.
pub type Cut = Pin<Box<dyn Future<Output = &'static str> + Send>>;

/// Cut when fleetgate's shutdown grace period is over (`draining`) or the node is
/// found dead (`lost`).
pub fn cut(draining: CancellationToken, lost: CancellationToken) -> Cut {
    Box::pin(async move {
        tokio::select! {
            biased;
            () = draining.cancelled_owned() => "fleetgate is shutting down",
            () = lost.cancelled_owned() => "the model server stopped answering",
        }
    })
}

#[cfg(test)]
mod tests {
    use std::task::Poll;

    use super::*;
    use crate::completion::watch::Watch;

    #[tokio::test]
    async fn a_watch_sees_either_token_and_wakes_its_task() {
        for (draining, reason) in [
            (true, "fleetgate is shutting down"),
            (false, "the model server stopped answering"),
        ] {
            let (drain, lost) = (CancellationToken::new(), CancellationToken::new());
            let mut watch = Watch::new(cut(drain.clone(), lost.clone()));
            let mut look = |cx: &mut std::task::Context<'_>| {
                watch.poll_with(cx, |cut, cx| cut.as_mut().poll(cx))
            };
            // Pending, looked at many times (as a stream does), then cut from another
            // task: the waiting task is woken and the watch has the reason.
            for _ in 0..3 {
                assert!(
                    std::future::poll_fn(|cx| Poll::Ready(look(cx)))
                        .await
                        .is_pending()
                );
            }
            let token = if draining { drain } else { lost };
            tokio::spawn(async move { token.cancel() });
            let got = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                std::future::poll_fn(&mut look),
            )
            .await
            .expect("the cut wakes the task that watches it");
            assert_eq!(got, reason);
        }
    }
}
