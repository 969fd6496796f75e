//! The key table: every key (prefix → record) in memory, so that authenticating a
//! request costs no store round trip.
//!
//! - **Loaded** whole at start ([`KeyTable::load`]).
//! - **Followed**: [`KeyTable::follow`] reads the store's change feed
//!   ([`Store::keys_changed_since`]: the keys changed after the last change number
//!   seen) at once when the store signals a change (PostgreSQL's LISTEN/NOTIFY) and
//!   every [`FOLLOW_EVERY`] in any case, so a key created, revoked or re-limited by
//!   another process (the CLI, another replica) takes effect here at once, or within
//!   that period when a signal is missed (SQLite has none). The process that makes a
//!   change pulls it at once ([`KeyTable::pull`]).
//! - **Misses** (a prefix not in the table: a key created elsewhere a moment ago, or no
//!   key at all) make no store query of their own: a miss waits for the follow loop's
//!   next pull (the next tick, at most [`FOLLOW_EVERY`] away, or the next change
//!   signal) and is answered from the table as that pull left it. That pull started
//!   after the request asked, so a key committed before then is found; a flood of
//!   unknown keys, at any rate, costs the store nothing beyond the follow loop's own
//!   reads. An unknown key is refused once that pull ends: normally within
//!   [`FOLLOW_EVERY`] plus one read of the feed, at most [`MISS_WAIT`] (a slow pull
//!   under way, then the next). The table's size stays the number of keys (nothing is
//!   remembered of a prefix that matched none).
//! - **Store outages**: hits are answered from memory; a miss that sees a pull fail (an
//!   error, or no answer within [`PULL_TIMEOUT`]), or no pull end within
//!   [`MISS_WAIT`], gets [`StoreError`], for the caller to refuse as unavailable rather
//!   than as unknown.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt as _;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::{KeyRecord, Store, StoreError};

/// How often [`KeyTable::follow`] reads the change feed.
pub const FOLLOW_EVERY: Duration = Duration::from_millis(250);
/// How long the follow loop waits before listening again for a store's change
/// signals after it could not (or the signals ended).
const LISTEN_AGAIN_AFTER: Duration = Duration::from_secs(5);
/// The longest one pull may take: a store that took the query and went silent must
/// not hold the requests waiting on a miss (nor an admin call) for ever.
pub const PULL_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a miss waits for a pull that started after it asked: the next tick, a
/// pull under way when it asked and the one after it, each at most [`PULL_TIMEOUT`].
pub const MISS_WAIT: Duration =
    Duration::from_millis(FOLLOW_EVERY.as_millis() as u64 + 2 * PULL_TIMEOUT.as_millis() as u64);

pub struct KeyTable {
    store: Arc<dyn Store>,
    by_prefix: RwLock<HashMap<Box<str>, Arc<KeyRecord>>>,
    /// The highest change number applied.
    seen: AtomicI64,
    /// Held for the duration of a pull (one at a time).
    pulling: tokio::sync::Mutex<()>,
    /// The pulls so far, which misses wait on.
    pulls: watch::Sender<Pulls>,
}

/// How many pulls have started and ended, and how the last one went.
#[derive(Clone, Copy)]
struct Pulls {
    started: u64,
    ended: u64,
    ok: bool,
}

impl KeyTable {
    /// Reads every key from the store.
    pub async fn load(store: Arc<dyn Store>) -> Result<Arc<Self>, StoreError> {
        let table = Self {
            store,
            by_prefix: RwLock::new(HashMap::new()),
            seen: AtomicI64::new(0),
            pulling: tokio::sync::Mutex::new(()),
            pulls: watch::Sender::new(Pulls {
                started: 0,
                ended: 0,
                ok: true,
            }),
        };
        table.apply_changes().await?;
        Ok(Arc::new(table))
    }

    /// The key with this prefix as the table has it now, revoked or not.
    pub fn get(&self, prefix: &str) -> Option<Arc<KeyRecord>> {
        self.read().get(prefix).cloned()
    }

    /// The key with this id, as the table has it now (a scan: for work off the request
    /// path, such as a job's run).
    pub fn by_id(&self, id: i64) -> Option<Arc<KeyRecord>> {
        self.read().values().find(|key| key.id == id).cloned()
    }

    /// The key with this prefix: from the table, or, when the table does not have it,
    /// as the follow loop's next pull leaves it (see the module notes).
    /// `Ok(None)`: no such key. `Err`: not in the table, and the store could not be
    /// asked.
    pub async fn find(&self, prefix: &str) -> Result<Option<Arc<KeyRecord>>, StoreError> {
        if let Some(found) = self.get(prefix) {
            return Ok(Some(found));
        }
        let mut pulls = self.pulls.subscribe();
        let asked = *pulls.borrow_and_update();
        // A pull numbered after `asked.started` starts after this miss: it has every key
        // committed before the request asked. A pull that fails meanwhile answers too:
        // the store is away, and the key cannot be told from one created a moment ago.
        let answered =
            pulls.wait_for(|now| now.ended > asked.started || (now.ended > asked.ended && !now.ok));
        let ok = matches!(
            tokio::time::timeout(MISS_WAIT, answered).await,
            Ok(Ok(now)) if now.ok
        );
        match self.get(prefix) {
            Some(found) => Ok(Some(found)),
            None if ok => Ok(None),
            None => Err(StoreError::Unavailable),
        }
    }

    /// Applies every change committed since the last pull; returns once it is in the
    /// table.
    pub async fn pull(&self) -> Result<(), StoreError> {
        let _one_at_a_time = self.pulling.lock().await;
        let was_ok = self.pulls.borrow().ok;
        self.pulls.send_modify(|pulls| pulls.started += 1);
        let ok = self.pull_logged(was_ok).await;
        self.pulls.send_modify(|pulls| {
            pulls.ended = pulls.started;
            pulls.ok = ok;
        });
        if ok {
            Ok(())
        } else {
            Err(StoreError::Unavailable)
        }
    }

    /// Pulls the change feed every [`FOLLOW_EVERY`], and at once on each signal of a
    /// store that announces changes, until `stop`; the table keeps answering from memory
    /// while the store is away.
    pub async fn follow(self: Arc<Self>, stop: CancellationToken) {
        let mut ticks = tokio::time::interval(FOLLOW_EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut signals = None;
        let mut listen_again = Instant::now();
        loop {
            if signals.is_none() && Instant::now() >= listen_again {
                // Bounded: misses wait on this loop's pulls, which a store slow to
                // give a listening connection must not hold up.
                let listen = tokio::time::timeout(PULL_TIMEOUT, self.store.key_change_signals());
                let Some(listening) = stop.run_until_cancelled(listen).await else {
                    return;
                };
                signals = listening.ok().flatten();
                listen_again = Instant::now() + LISTEN_AGAIN_AFTER;
            }
            let signal = async {
                match signals.as_mut() {
                    Some(signals) => signals.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {}
                signal = signal => {
                    if signal.is_none() {
                        signals = None;
                    }
                }
            }
            // Ends with `stop` even while the store does not answer.
            if stop.run_until_cancelled(self.pull()).await.is_none() {
                return;
            }
        }
    }

    /// One pull; logs the start and the end of an outage (`was_ok`: how the last pull
    /// went), not every failed pull. Whether it went well.
    async fn pull_logged(&self, was_ok: bool) -> bool {
        let ok = match self.apply_changes().await {
            Ok(()) => true,
            Err(err) => {
                if was_ok {
                    tracing::warn!(error = %err, "could not read the key change feed; answering from the keys in memory until it can");
                }
                false
            }
        };
        if ok && !was_ok {
            tracing::info!("the key change feed can be read again");
        }
        ok
    }

    async fn apply_changes(&self) -> Result<(), StoreError> {
        let since = self.seen.load(Ordering::Acquire);
        let changes = tokio::time::timeout(PULL_TIMEOUT, self.store.keys_changed_since(since))
            .await
            .map_err(|_| StoreError::Unavailable)??;
        let Some(newest) = changes.last().map(|change| change.seq) else {
            return Ok(());
        };
        let mut table = self
            .by_prefix
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for change in changes {
            table.insert(
                change.record.prefix.clone().into_boxed_str(),
                Arc::new(change.record),
            );
        }
        self.seen.fetch_max(newest, Ordering::AcqRel);
        Ok(())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<Box<str>, Arc<KeyRecord>>> {
        // The table is only ever replaced entry by entry: a panic elsewhere leaves it
        // whole.
        self.by_prefix
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
