//! The in-process limiter: exact for one replica. Every decision is made under one
//! mutex (never held across an await); waiters park on a per-key `Notify`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rustc_hash::FxHashMap;
use tokio::sync::{Notify, OnceCell, watch};

use super::{Admitted, Cost, Denial, Grant, KeyLimits, Lease, Limiter, Month, Usage, UsageSource};
use super::{QUEUE_FULL_RETRY_AFTER, QUEUE_PLACE_GONE};

/// One cell per key and month, set once the counter includes the ledger.
type SeedCells = FxHashMap<(i64, Month), Arc<OnceCell<()>>>;

pub struct LocalLimiter {
    keys: Mutex<FxHashMap<i64, KeyState>>,
    /// Bumped whenever a slot or queue place changes hands (see [`LocalLimiter::changes`]).
    changes: watch::Sender<u64>,
    /// Counters seeded from the ledger, once per key and month.
    seeds: Mutex<SeedCells>,
    source: Arc<dyn UsageSource>,
}

#[derive(Default)]
struct KeyState {
    /// GCRA theoretical arrival time.
    tat: Option<Instant>,
    /// Leases holding a running slot, with their reservation.
    running: FxHashMap<String, Grant>,
    /// Leases waiting, in arrival order.
    queue: VecDeque<String>,
    months: FxHashMap<Month, Usage>,
    wake: Arc<Notify>,
}

impl LocalLimiter {
    pub fn new(source: Arc<dyn UsageSource>) -> Self {
        Self {
            keys: Mutex::new(FxHashMap::default()),
            changes: watch::Sender::new(0),
            seeds: Mutex::new(FxHashMap::default()),
            source,
        }
    }

    /// A receiver that sees every change of slots and queues: lets a caller wait for an
    /// occupancy (tests, diagnostics) without polling.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    fn lock(&self) -> MutexGuard<'_, FxHashMap<i64, KeyState>> {
        // A panic while holding the lock leaves consistent counters (every update is a
        // single assignment), so a poisoned lock is still usable.
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes sure the key's counter for `month` includes what the ledger recorded before
    /// this process counted. Usage settled while the ledger is read is added to the
    /// counter directly, so it may be counted twice (never missed): the error is on the
    /// side of refusing.
    async fn seed(&self, key: i64, month: Month) -> Result<(), Denial> {
        let cell = {
            let mut seeds = self.seeds.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(seeds.entry((key, month)).or_default())
        };
        cell.get_or_try_init(|| async {
            self.lock()
                .entry(key)
                .or_default()
                .months
                .entry(month)
                .or_default();
            let recorded = self
                .source
                .month_usage(key, month)
                .await
                .map_err(Denial::Unavailable)?;
            let mut keys = self.lock();
            let usage = keys
                .entry(key)
                .or_default()
                .months
                .entry(month)
                .or_default();
            usage.used = usage.used.saturating_add(recorded);
            Ok(())
        })
        .await
        .map(|_| ())
    }
}

impl KeyState {
    /// GCRA: a burst of `rpm` starts, then one every `60 s / rpm`. How long until the
    /// next start is allowed (zero: now), and the arrival time after that start.
    fn rate_wait(&self, rpm: u32, now: Instant) -> (Duration, Instant) {
        let interval = Duration::from_secs(60) / rpm.max(1);
        let tolerance = interval * rpm.max(1).saturating_sub(1);
        let tat = self.tat.unwrap_or(now).max(now);
        let allowed_at = tat.checked_sub(tolerance).unwrap_or(now);
        (allowed_at.saturating_duration_since(now), tat + interval)
    }

    /// Counts a start against the rate, or refuses it.
    fn check_rate(&mut self, rpm: u32, now: Instant) -> Result<(), Denial> {
        let (wait, next) = self.rate_wait(rpm, now);
        if !wait.is_zero() {
            return Err(Denial::RateLimited { retry_after: wait });
        }
        self.tat = Some(next);
        Ok(())
    }

    /// Whether a request may take a running slot now: one is free and nobody waits.
    fn may_start(&self, limits: &KeyLimits) -> bool {
        self.queue.is_empty() && self.has_free_slot(limits)
    }

    /// Whether the wait queue has no place left.
    fn queue_full(&self, limits: &KeyLimits) -> bool {
        self.queue.len() >= limits.max_queued as usize
    }

    /// Takes a slot and reserves the budget, or refuses on the budget.
    fn start(
        &mut self,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
        month: Month,
    ) -> Result<Grant, Denial> {
        let usage = self.months.entry(month).or_default();
        let available = limits
            .monthly_budget
            .saturating_sub(usage.used.saturating_add(usage.reserved));
        let Some(max_tokens) = cost.fit(available) else {
            return Err(Denial::BudgetExceeded {
                budget: limits.monthly_budget,
                used: usage.used,
                reserved: usage.reserved,
                needed: cost.prompt_tokens.saturating_add(cost.fan_out),
                month,
            });
        };
        let reserved = Cost {
            max_tokens,
            ..*cost
        }
        .worst_case();
        usage.reserved += reserved;
        let grant = Grant {
            max_tokens,
            reserved,
            month,
        };
        self.running.insert(lease.to_owned(), grant.clone());
        Ok(grant)
    }

    fn has_free_slot(&self, limits: &KeyLimits) -> bool {
        self.running.len() < limits.max_concurrent as usize
    }
}

#[async_trait]
impl Limiter for LocalLimiter {
    async fn admit(
        &self,
        key: i64,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
    ) -> Result<Admitted, Denial> {
        let month = Month::now();
        self.seed(key, month).await?;
        let mut keys = self.lock();
        let state = keys.entry(key).or_default();
        if limits.requests_per_minute > 0 {
            state.check_rate(limits.requests_per_minute, Instant::now())?;
        }
        let admitted = if state.may_start(limits) {
            state
                .start(limits, cost, lease, month)
                .map(Admitted::Running)
        } else if state.queue_full(limits) {
            Err(Denial::QueueFull {
                retry_after: QUEUE_FULL_RETRY_AFTER,
            })
        } else {
            state.queue.push_back(lease.to_owned());
            Ok(Admitted::Queued)
        };
        drop(keys);
        self.changed();
        admitted
    }

    async fn peek(&self, key: i64, limits: &KeyLimits) -> Result<(), Denial> {
        let keys = self.lock();
        let Some(state) = keys.get(&key) else {
            return Ok(());
        };
        if limits.requests_per_minute > 0 {
            let wait = state
                .rate_wait(limits.requests_per_minute, Instant::now())
                .0;
            if !wait.is_zero() {
                return Err(Denial::RateLimited { retry_after: wait });
            }
        }
        if !state.may_start(limits) && state.queue_full(limits) {
            return Err(Denial::QueueFull {
                retry_after: QUEUE_FULL_RETRY_AFTER,
            });
        }
        Ok(())
    }

    async fn wait_turn(
        &self,
        key: i64,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
    ) -> Result<Grant, Denial> {
        loop {
            let month = Month::now();
            self.seed(key, month).await?;
            let wake = {
                let mut keys = self.lock();
                let state = keys.entry(key).or_default();
                if !state.queue.iter().any(|l| l == lease) {
                    // It left (or was never queued): waiting would never end.
                    return Err(Denial::Unavailable(QUEUE_PLACE_GONE.to_owned()));
                }
                let first = state.queue.front().is_some_and(|l| l == lease);
                if first && state.has_free_slot(limits) {
                    state.queue.pop_front();
                    let started = state.start(limits, cost, lease, month);
                    // The next in line may start too (or learn it is now first).
                    state.wake.notify_waiters();
                    drop(keys);
                    self.changed();
                    return started;
                }
                Arc::clone(&state.wake)
            };
            let notified = wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Re-check after registering, so a wake-up between the check and the
            // registration is not lost.
            let ready = {
                let keys = self.lock();
                keys.get(&key).is_none_or(|s| {
                    s.queue.front().is_some_and(|l| l == lease) && s.has_free_slot(limits)
                })
            };
            if !ready {
                notified.await;
            }
        }
    }

    async fn count_start(&self, key: i64, rpm: u32) -> Result<(), Denial> {
        self.lock()
            .entry(key)
            .or_default()
            .check_rate(rpm, Instant::now())
    }

    async fn leave(&self, key: i64, lease: &Lease) -> Result<(), Denial> {
        let mut keys = self.lock();
        if let Some(state) = keys.get_mut(&key) {
            state.queue.retain(|l| l != lease);
            state.wake.notify_waiters();
        }
        drop(keys);
        self.changed();
        Ok(())
    }

    async fn finish(
        &self,
        key: i64,
        lease: &Lease,
        grant: &Grant,
        used_tokens: u64,
    ) -> Result<(), Denial> {
        let mut keys = self.lock();
        let state = keys.entry(key).or_default();
        if state.running.remove(lease).is_none() {
            return Ok(());
        }
        let usage = state.months.entry(grant.month).or_default();
        usage.reserved = usage.reserved.saturating_sub(grant.reserved);
        usage.used = usage.used.saturating_add(used_tokens);
        state.wake.notify_waiters();
        drop(keys);
        self.changed();
        Ok(())
    }

    async fn renew(&self, _key: i64, _lease: &Lease) -> Result<(), Denial> {
        // Leases live as long as this process; nothing expires.
        Ok(())
    }

    async fn usage(&self, key: i64, month: Month) -> Result<Usage, Denial> {
        self.seed(key, month).await?;
        Ok(self
            .lock()
            .get(&key)
            .and_then(|s| s.months.get(&month).copied())
            .unwrap_or_default())
    }

    async fn occupancy(&self, key: i64) -> Result<(u32, u32), Denial> {
        let keys = self.lock();
        Ok(keys.get(&key).map_or((0, 0), |s| {
            (
                u32::try_from(s.running.len()).unwrap_or(u32::MAX),
                u32::try_from(s.queue.len()).unwrap_or(u32::MAX),
            )
        }))
    }
}
