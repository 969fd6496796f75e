//! Wake-ups: a request waiting in a key's queue goes on as soon as a slot or queue place
//! of that key frees on any replica, not only at its next poll. The scripts publish the
//! key id on the pub/sub channel `P:wake` when that happens while somebody waits in the
//! key's queue; each limiter holds one subscription (started by its first waiter) and
//! wakes its local waiters of that key. A lost message delays a waiter by at most its
//! poll ([`RedisLimiterOptions::poll_interval`]).

use rustc_hash::FxHashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use ::redis::aio::PubSub;
use futures_util::StreamExt as _;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;
use tokio::task::AbortHandle;

use super::options::RedisLimiterOptions;
use super::target::RedisTarget;
use crate::backoff::Backoff;

/// How often the subscription connection is checked with a PING.
const SUBSCRIPTION_PING: Duration = Duration::from_secs(5);
/// The longest pause between two attempts to resubscribe.
const RESUBSCRIBE_MAX_PAUSE: Duration = Duration::from_secs(5);

/// One limiter's wake-ups: its local waiters and the subscription that wakes them.
pub(super) struct Wakeups {
    target: Arc<RedisTarget>,
    channel: String,
    options: RedisLimiterOptions,
    hub: Arc<Hub>,
    /// The subscription task, started by the first waiter.
    subscriber: OnceLock<AbortHandle>,
}

impl Wakeups {
    /// Wake-ups from `channel` on the Redis `target`; subscribes only once a request
    /// waits.
    pub(super) fn new(
        target: Arc<RedisTarget>,
        channel: String,
        options: RedisLimiterOptions,
    ) -> Self {
        Self {
            target,
            channel,
            options,
            hub: Arc::new(Hub::default()),
            subscriber: OnceLock::new(),
        }
    }

    /// Registers a waiter of `key`, woken by each message for `key` and after each
    /// (re)subscription; starts the subscription if it is not running yet.
    pub(super) fn watch(&self, key: i64) -> Watch {
        self.subscribe();
        Hub::watch(&self.hub, key)
    }

    /// Starts the subscription task (once), which wakes local waiters on a message.
    fn subscribe(&self) {
        self.subscriber.get_or_init(|| {
            tokio::spawn(subscription(
                Arc::clone(&self.target),
                self.channel.clone(),
                Arc::downgrade(&self.hub),
                self.options,
            ))
            .abort_handle()
        });
    }
}

impl Drop for Wakeups {
    fn drop(&mut self) {
        if let Some(task) = self.subscriber.get() {
            task.abort();
        }
    }
}

/// The local waiters per key, woken by the subscription.
#[derive(Default)]
struct Hub {
    keys: Mutex<FxHashMap<i64, (Arc<Notify>, usize)>>,
}

/// A waiter's registration with the hub; unregisters when dropped.
pub(super) struct Watch {
    hub: Arc<Hub>,
    key: i64,
    notify: Arc<Notify>,
}

impl Watch {
    /// The next wake-up of the watched key (see [`Notify::notified`]).
    pub(super) fn notified(&self) -> Notified<'_> {
        self.notify.notified()
    }
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, FxHashMap<i64, (Arc<Notify>, usize)>> {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn watch(hub: &Arc<Self>, key: i64) -> Watch {
        let mut keys = hub.lock();
        let entry = keys
            .entry(key)
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        Watch {
            hub: Arc::clone(hub),
            key,
            notify: Arc::clone(&entry.0),
        }
    }

    fn wake(&self, key: i64) {
        if let Some((notify, _)) = self.lock().get(&key) {
            notify.notify_waiters();
        }
    }

    fn wake_all(&self) {
        for (notify, _) in self.lock().values() {
            notify.notify_waiters();
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut keys = self.hub.lock();
        if let Some(entry) = keys.get_mut(&self.key) {
            entry.1 -= 1;
            if entry.1 == 0 {
                keys.remove(&self.key);
            }
        }
    }
}

/// Holds one subscription to the wake-up channel for as long as the limiter lives,
/// resubscribing after a failure; wakes every local waiter after each (re)subscription,
/// since messages may have been missed meanwhile.
async fn subscription(
    target: Arc<RedisTarget>,
    channel: String,
    hub: Weak<Hub>,
    options: RedisLimiterOptions,
) {
    let mut pauses = Backoff::new(options.poll_interval, RESUBSCRIBE_MAX_PAUSE).pauses();
    loop {
        let connect = async {
            let stream = target.address.connect().await?;
            let mut pubsub = PubSub::new(&target.settings, stream)
                .await
                .map_err(|e| e.to_string())?;
            pubsub
                .subscribe(&channel)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(pubsub)
        };
        let bound = options.connect_timeout + options.call_timeout;
        match tokio::time::timeout(bound, connect).await {
            Ok(Ok(pubsub)) => {
                pauses.reset();
                let Some(live) = hub.upgrade() else { return };
                live.wake_all();
                drop(live);
                let (mut sink, mut messages) = pubsub.split();
                let mut ping = tokio::time::interval(SUBSCRIPTION_PING);
                ping.tick().await;
                loop {
                    tokio::select! {
                        message = messages.next() => {
                            let Some(message) = message else { break };
                            let Some(live) = hub.upgrade() else { return };
                            if let Ok(key) = message.get_payload::<i64>() {
                                live.wake(key);
                            }
                        }
                        _ = ping.tick() => {
                            if hub.strong_count() == 0 {
                                return;
                            }
                            let pong = tokio::time::timeout(
                                options.call_timeout,
                                sink.ping::<::redis::Value>(),
                            )
                            .await;
                            if !matches!(pong, Ok(Ok(_))) {
                                break;
                            }
                        }
                    }
                }
                tracing::debug!("redis limiter: wake-up subscription lost; resubscribing");
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "redis limiter: cannot subscribe"),
            Err(_) => tracing::debug!("redis limiter: subscribing timed out"),
        }
        if hub.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(pauses.next_pause()).await;
    }
}
