//! Polling something only when it may have changed. A streamed body looks at the same
//! things before every piece it relays — whether it must be cut short, whether the
//! upstream has more — and most looks find nothing new: a paced stream's task is woken
//! once a frame, and hyper polls the body again after each piece. A [`Watch`] polls
//! what it holds with a waker of its own that notes each wake-up (and passes it on to
//! the task), so a look after a `Pending` with no wake-up since is an atomic swap.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

pub struct Watch<T> {
    inner: T,
    woken: Arc<Woken>,
    /// `woken` as a waker, made once.
    waker: Waker,
}

struct Woken {
    /// Set by each wake-up, after each `Ready`, and at the start: the next look polls.
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

impl<T> Watch<T> {
    pub fn new(inner: T) -> Self {
        let woken = Arc::new(Woken {
            again: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Self {
            inner,
            waker: Waker::from(Arc::clone(&woken)),
            woken,
        }
    }

    /// `poll` of what it holds, unless that was `Pending` when last polled and nothing
    /// has woken it since: then `Pending` without polling. Either way the task of `cx`
    /// is woken when it is.
    pub fn poll_with<R>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(&mut T, &mut Context<'_>) -> Poll<R>,
    ) -> Poll<R> {
        self.woken.task.register(cx.waker());
        if !self.woken.again.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        let polled = poll(&mut self.inner, &mut Context::from_waker(&self.waker));
        if polled.is_ready() {
            self.woken.again.store(true, Ordering::Release);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::mpsc;

    use super::*;

    /// A channel's receiving end that counts how often it is polled.
    struct Counted {
        receive: mpsc::Receiver<u32>,
        polls: usize,
    }

    fn look(watch: &mut Watch<Counted>, cx: &mut Context<'_>) -> Poll<Option<u32>> {
        watch.poll_with(cx, |counted, cx| {
            counted.polls += 1;
            counted.receive.poll_recv(cx)
        })
    }

    #[tokio::test]
    async fn what_is_watched_is_polled_again_only_after_a_wake_up_or_an_item() {
        let (send, receive) = mpsc::channel(8);
        let mut watch = Watch::new(Counted { receive, polls: 0 });
        send.send(1).await.unwrap();
        send.send(2).await.unwrap();
        // An item a look, then one Pending; the looks after it poll nothing.
        let mut looks = Vec::new();
        for _ in 0..5 {
            looks.push(std::future::poll_fn(|cx| Poll::Ready(look(&mut watch, cx))).await);
        }
        assert_eq!(
            looks,
            [
                Poll::Ready(Some(1)),
                Poll::Ready(Some(2)),
                Poll::Pending,
                Poll::Pending,
                Poll::Pending
            ]
        );
        assert_eq!(watch.inner.polls, 3);
        // An item sent from another task wakes the waiting task, which then gets it.
        tokio::spawn(async move { send.send(3).await });
        let next = tokio::time::timeout(
            Duration::from_secs(5),
            std::future::poll_fn(|cx| look(&mut watch, cx)),
        )
        .await
        .expect("the item wakes the task that watches");
        assert_eq!(next, Some(3));
    }
}
