//! When a relayed answer must be cut short: fleetgate's shutdown grace period is over,
//! or its node was found dead. A streamed body looks at this between the pieces it
//! relays, and before it waits for the next.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::sync::CancellationToken;

use crate::completion::watch::Watch;

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

/// A [`Cut`] that costs next to nothing to look at until it may have happened: polling
/// the cut itself polls two cancellation tokens, each behind a mutex, and a paced
/// stream looks at every frame.
pub struct CutWatch(Watch<Cut>);

impl CutWatch {
    pub fn new(cut: Cut) -> Self {
        Self(Watch::new(cut))
    }

    /// Ready with the reason once the body must be cut; until then, the task of `cx` is
    /// woken when it is.
    pub fn poll(&mut self, cx: &mut Context<'_>) -> Poll<&'static str> {
        self.0.poll_with(cx, |cut, cx| cut.as_mut().poll(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_watch_sees_either_token_and_wakes_its_task() {
        for (draining, reason) in [
            (true, "fleetgate is shutting down"),
            (false, "the model server stopped answering"),
        ] {
            let (drain, lost) = (CancellationToken::new(), CancellationToken::new());
            let mut watch = CutWatch::new(cut(drain.clone(), lost.clone()));
            // Pending, looked at many times (as a stream does), then cut from another
            // task: the waiting task is woken and the watch has the reason.
            for _ in 0..3 {
                assert!(
                    std::future::poll_fn(|cx| Poll::Ready(watch.poll(cx)))
                        .await
                        .is_pending()
                );
            }
            let token = if draining { drain } else { lost };
            tokio::spawn(async move { token.cancel() });
            let got = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                std::future::poll_fn(|cx| watch.poll(cx)),
            )
            .await
            .expect("the cut wakes the task that watches it");
            assert_eq!(got, reason);
        }
    }
}
