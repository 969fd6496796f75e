//! Polling something only when it may have changed. A streamed body looks at the same
//! things before every piece it relays — whether it must be cut short, whether the
//! upstream has more — and most looks find nothing new: a paced stream's task is woken
//! once a frame, and hyper polls the body again after each piece. A [`Watch`] polls
//! what it holds with a waker of its own that notes each wake-up (and passes it on to
//! the task), so a look after a `Pending` with no wake-up since is an atomic swap. The
//! task's waker is handed over only when the one handed over last may be gone: after a
//! wake-up (which takes it) or when another task looks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

pub struct Watch<T> {
    inner: T,
    woken: Arc<Woken>,
    /// `woken` as a waker, made once.
    waker: Waker,
    /// The task's waker last registered in `woken.task`, and `woken.wakes` when it was.
    registered: Option<(Waker, u64)>,
}

struct Woken {
    /// Set by each wake-up, after each `Ready`, and at the start: the next look polls.
    again: AtomicBool,
    /// Wake-ups so far, each counted before it takes the task's waker out of `task`: a
    /// look that sees no new one finds its waker still there.
    wakes: AtomicU64,
    /// The task that looks, woken in turn.
    task: AtomicWaker,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.again.store(true, Ordering::Release);
        self.wakes.fetch_add(1, Ordering::AcqRel);
        self.task.wake();
    }
}

impl<T> Watch<T> {
    pub fn new(inner: T) -> Self {
        let woken = Arc::new(Woken {
            again: AtomicBool::new(true),
            wakes: AtomicU64::new(0),
            task: AtomicWaker::new(),
        });
        Self {
            inner,
            waker: Waker::from(Arc::clone(&woken)),
            woken,
            registered: None,
        }
    }

    /// `poll` of what it holds, unless that was `Pending` when last polled and nothing
    /// has woken it since: then `Pending` without polling. Either way the task of `cx`
    /// is woken when it is.
    #[inline]
    pub fn poll_with<R>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(&mut T, &mut Context<'_>) -> Poll<R>,
    ) -> Poll<R> {
        self.register(cx.waker());
        if !self.woken.again.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        let polled = poll(&mut self.inner, &mut Context::from_waker(&self.waker));
        if polled.is_ready() {
            self.woken.again.store(true, Ordering::Release);
        }
        polled
    }

    /// Makes sure `task` is woken by the next wake-up. A wake-up between reading the
    /// count and registering only makes the next look register again.
    fn register(&mut self, task: &Waker) {
        let wakes = self.woken.wakes.load(Ordering::Acquire);
        if let Some((waker, at)) = &self.registered
            && *at == wakes
            && waker.will_wake(task)
        {
            return;
        }
        self.woken.task.register(task);
        self.registered = Some((task.clone(), wakes));
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

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct Wakes(std::sync::atomic::AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_task_that_looked_last_is_woken_by_every_wake_up() {
        let (send, receive) = mpsc::channel(8);
        let mut watch = Watch::new(Counted { receive, polls: 0 });
        let (a, b) = (Arc::new(Wakes::default()), Arc::new(Wakes::default()));
        let (waker_a, waker_b) = (Waker::from(Arc::clone(&a)), Waker::from(Arc::clone(&b)));
        let mut cx_a = Context::from_waker(&waker_a);
        let mut cx_b = Context::from_waker(&waker_b);
        let woken = || (a.0.load(Ordering::SeqCst), b.0.load(Ordering::SeqCst));

        assert_eq!(look(&mut watch, &mut cx_a), Poll::Pending);
        // Another task looks: it is the one woken, though nothing was polled for it.
        assert_eq!(look(&mut watch, &mut cx_b), Poll::Pending);
        assert_eq!(watch.inner.polls, 1);
        send.try_send(1).unwrap();
        assert_eq!(woken(), (0, 1));
        // Each wake-up takes the task's waker; the looks after it hand it over again.
        for item in 2..5 {
            assert_eq!(look(&mut watch, &mut cx_b), Poll::Ready(Some(item - 1)));
            assert_eq!(look(&mut watch, &mut cx_b), Poll::Pending);
            assert_eq!(look(&mut watch, &mut cx_b), Poll::Pending);
            send.try_send(item).unwrap();
            assert_eq!(woken(), (0, item as usize));
        }
    }
}
