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
//!   key at all) pull the feed before answering, but never more than one pull at a
//!   time and never closer together than [`MISS_PULL_SPACING`]: a flood of unknown
//!   keys costs at most one store query per spacing, whatever its rate, and the table's
//!   size stays the number of keys (nothing is remembered of a prefix that matched
//!   none).
//! - **Store outages**: hits are answered from memory; a miss that cannot pull (an
//!   error, or no answer within [`PULL_TIMEOUT`]) gets [`StoreError`], for the caller to
//!   refuse as unavailable rather than as unknown.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt as _;
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
/// The least time between two pulls made for misses.
pub const MISS_PULL_SPACING: Duration = Duration::from_millis(50);

pub struct KeyTable {
    store: Arc<dyn Store>,
    by_prefix: RwLock<HashMap<Box<str>, Arc<KeyRecord>>>,
    /// The highest change number applied.
    seen: AtomicI64,
    /// Held for the duration of a pull (one at a time); what the last one was.
    pulls: tokio::sync::Mutex<LastPull>,
}

#[derive(Clone, Copy)]
struct LastPull {
    started: Instant,
    ok: bool,
}

impl KeyTable {
    /// Reads every key from the store.
    pub async fn load(store: Arc<dyn Store>) -> Result<Arc<Self>, StoreError> {
        let table = Self {
            store,
            by_prefix: RwLock::new(HashMap::new()),
            seen: AtomicI64::new(0),
            pulls: tokio::sync::Mutex::new(LastPull {
                started: Instant::now(),
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

    /// The key with this prefix: from the table, or after a pull of the change feed
    /// when the table does not have it (see the module notes for the bounds).
    /// `Ok(None)`: no such key. `Err`: not in the table, and the store could not be
    /// asked.
    pub async fn find(&self, prefix: &str) -> Result<Option<Arc<KeyRecord>>, StoreError> {
        if let Some(found) = self.get(prefix) {
            return Ok(Some(found));
        }
        let asked = Instant::now();
        let mut last = self.pulls.lock().await;
        // A pull that started after this request asked has everything committed before
        // it: its answer is this request's answer too.
        if last.started < asked {
            tokio::time::sleep_until(last.started + MISS_PULL_SPACING).await;
            *last = self.pull_locked(last.ok).await;
        }
        let ok = last.ok;
        drop(last);
        match self.get(prefix) {
            Some(found) => Ok(Some(found)),
            None if ok => Ok(None),
            None => Err(StoreError::Unavailable),
        }
    }

    /// Applies every change committed since the last pull; returns once it is in the
    /// table.
    pub async fn pull(&self) -> Result<(), StoreError> {
        let mut last = self.pulls.lock().await;
        *last = self.pull_locked(last.ok).await;
        if last.ok {
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
                let Some(listening) = stop
                    .run_until_cancelled(self.store.key_change_signals())
                    .await
                else {
                    return;
                };
                signals = listening;
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
    /// went), not every failed pull.
    async fn pull_locked(&self, was_ok: bool) -> LastPull {
        let started = Instant::now();
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
        LastPull { started, ok }
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
