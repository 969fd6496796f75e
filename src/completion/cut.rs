//! When a relayed answer must be cut short: fleetgate's shutdown grace period is over,
//! or its node was found dead. A streamed body looks at this between the pieces it
//! relays, and before it waits for the next.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio_util::sync::CancellationToken;

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

/// A [`Cut`] that costs next to nothing to look at until it may have happened. Polling
/// the cut itself polls two cancellation tokens, each behind a mutex; a paced stream
/// would do that at every frame. The watch polls it only with a waker of its own that
/// notes each wake-up (and passes it on to the task), so a look in between is an atomic
/// swap.
pub struct CutWatch {
    cut: Cut,
    woken: Arc<Woken>,
    /// `woken` as a waker, made once.
    waker: Waker,
}

struct Woken {
    /// Set by each wake-up of the cut (and at the start): the next look polls it.
    again: AtomicBool,
    /// The task that looks, woken in turn.
    task: AtomicWaker,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.again.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl CutWatch {
    pub fn new(cut: Cut) -> Self {
        let woken = Arc::new(Woken {
            again: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Self {
            cut,
            waker: Waker::from(Arc::clone(&woken)),
            woken,
        }
    }

    /// Ready with the reason once the body must be cut; until then, the task of `cx` is
    /// woken when it is.
    pub fn poll(&mut self, cx: &mut Context<'_>) -> Poll<&'static str> {
        self.woken.task.register(cx.waker());
        if !self.woken.again.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        self.cut
            .as_mut()
            .poll(&mut Context::from_waker(&self.waker))
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
