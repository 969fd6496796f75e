//! Admission: whether a key may start a request now, and how much of its monthly budget
//! the request may use. Three limits per key, checked in one step (one Redis round trip
//! with the shared backend):
//!
//! 1. **rate** — a GCRA over `requests_per_minute`, bursts allowed up to that many;
//! 2. **concurrency** — `max_concurrent` running, the next `max_queued` waiting in arrival
//!    order, the rest refused (`queue_full`);
//! 3. **budget** — the worst case (`prompt_tokens + fan_out × max_tokens`) is reserved
//!    before forwarding and settled to the real usage afterwards; when it does not fit,
//!    `max_tokens` is reduced to what does (the clamp), and when nothing fits the request
//!    is refused (`budget_exceeded`).
//!
//! The live counters sit behind [`Limiter`] (in process, or Redis for several replicas);
//! the durable truth is the usage ledger in the store, from which counters are rebuilt.

#[cfg(test)]
mod fake;
pub mod give_back;
pub mod ledger;
pub mod local;
pub mod month;
pub mod redis;
pub mod renewals;
pub mod unlimited;

use std::time::Duration;

use async_trait::async_trait;

pub use month::Month;

use crate::config::LimitDefaults;
use crate::store::{LimitOverrides, UsageRow};

/// Suggested wait after `queue_full`, whichever backend refused.
pub(crate) const QUEUE_FULL_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Why [`Limiter::wait_turn`] fails for a lease that is not in the queue.
pub(crate) const QUEUE_PLACE_GONE: &str =
    "the request's queue place is gone (it left, or its lease expired)";

/// The limits that apply to one key (its overrides over the configured defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLimits {
    /// Prompt + completion tokens per calendar month (UTC).
    pub monthly_budget: u64,
    /// Request starts per minute; a burst of this many is allowed. 0: the start is not
    /// counted against the rate at all ([`KeyLimits::without_rate`]; a configured rate
    /// is at least 1).
    pub requests_per_minute: u32,
    /// Requests running at once.
    pub max_concurrent: u32,
    /// Requests waiting for a running slot, beyond which `queue_full`.
    pub max_queued: u32,
    /// The key's weight in its models' fleet queues: while the fleet is saturated, keys
    /// with work waiting get node slots in proportion to their share, counted in tokens.
    /// Not an admission limit: the limiter never reads it.
    pub share: u32,
}

impl KeyLimits {
    /// These limits for a start that does not count against the key's rate (a job's
    /// run: its submission did); slots and budget apply as ever.
    pub fn without_rate(self) -> Self {
        Self {
            requests_per_minute: 0,
            ..self
        }
    }

    /// The key's overrides over the configured defaults.
    pub fn resolve(defaults: &LimitDefaults, own: &LimitOverrides) -> Self {
        Self {
            monthly_budget: own.monthly_budget.unwrap_or(defaults.monthly_budget),
            requests_per_minute: own
                .requests_per_minute
                .unwrap_or(defaults.requests_per_minute),
            max_concurrent: own.max_concurrent.unwrap_or(defaults.max_concurrent),
            max_queued: own.max_queued.unwrap_or(defaults.max_queued),
            share: own.share.unwrap_or(defaults.share),
        }
    }
}

/// What a request may cost: `prompt_tokens + fan_out × max_tokens` at worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    /// Prompt tokens of all prompts (exact, or an upper bound).
    pub prompt_tokens: u64,
    /// Completions generated per output token step: `prompt_count × n`.
    pub fan_out: u64,
    /// The `max_tokens` the request would run with (the client's, or the default).
    pub max_tokens: u64,
}

impl Cost {
    pub fn worst_case(&self) -> u64 {
        self.prompt_tokens
            .saturating_add(self.fan_out.saturating_mul(self.max_tokens))
    }

    /// The largest `max_tokens` (≤ the requested one) whose worst case fits `available`
    /// tokens, or `None` when not even one token per completion fits.
    pub fn fit(&self, available: u64) -> Option<u64> {
        let room = available.checked_sub(self.prompt_tokens)?;
        let max_tokens = (room / self.fan_out.max(1)).min(self.max_tokens);
        (max_tokens >= 1).then_some(max_tokens)
    }
}

/// Identifies one admission attempt (the request id): its slot lease, queue ticket and
/// budget reservation all carry it.
pub type Lease = str;

/// A running slot with its budget reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The `max_tokens` the request may run with (< the requested one: clamped).
    pub max_tokens: u64,
    /// Tokens reserved: the worst case at `max_tokens`.
    pub reserved: u64,
    /// The month the reservation (and the usage) counts against.
    pub month: Month,
}

/// The outcome of [`Limiter::admit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admitted {
    Running(Grant),
    /// Waiting in the key's queue; call [`Limiter::wait_turn`].
    Queued,
}

/// Why a request may not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denial {
    #[error("rate limited")]
    RateLimited { retry_after: Duration },
    #[error("queue full")]
    QueueFull { retry_after: Duration },
    #[error("budget exceeded")]
    BudgetExceeded {
        budget: u64,
        used: u64,
        reserved: u64,
        needed: u64,
        month: Month,
    },
    /// The shared counters cannot be reached; budgets fail closed.
    #[error("admission backend unavailable: {0}")]
    Unavailable(String),
}

/// Used and reserved tokens of a key for a month.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub used: u64,
    pub reserved: u64,
}

/// The live counters. Every method is one step against the backend (one Redis round
/// trip). Implementations must be exact under concurrency: two admissions never both
/// take the last slot or the last budget tokens.
#[async_trait]
pub trait Limiter: Send + Sync + 'static {
    /// Checks the rate, then either takes a running slot and reserves the budget
    /// (`Running`), or joins the back of the wait queue (`Queued`), or refuses. A refusal
    /// changes nothing but the rate counter (a queue_full or budget refusal still counts
    /// as a start against the rate).
    async fn admit(
        &self,
        key: i64,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
    ) -> Result<Admitted, Denial>;

    /// Whether [`Limiter::admit`] would refuse the key now on its rate or on its full
    /// queue, taking nothing: a request it would refuse is refused before anything that
    /// costs the fleet is done for it (counting its prompt's tokens). One let through is
    /// decided again, and counted, by `admit`.
    async fn peek(&self, key: i64, limits: &KeyLimits) -> Result<(), Denial>;

    /// Counts one start against the key's rate (`rpm`, at least 1), as [`Limiter::admit`]
    /// does, and takes nothing else: no slot, no queue place, no budget. For requests
    /// that run no completion but must not be free (the Workbench's routes). Refuses
    /// with `RateLimited` (or `Unavailable`) only.
    async fn count_start(&self, key: i64, rpm: u32) -> Result<(), Denial>;

    /// For a queued lease: waits until it is first in its key's queue and a slot is free,
    /// then takes the slot and reserves the budget (in one step). If the budget refuses,
    /// the lease leaves the queue. Dropping the future does not leave the queue: call
    /// [`Limiter::leave`]. A lease that is not (or no longer) queued gets `Unavailable`.
    async fn wait_turn(
        &self,
        key: i64,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
    ) -> Result<Grant, Denial>;

    /// Leaves the queue (a waiting client went away). Idempotent.
    async fn leave(&self, key: i64, lease: &Lease) -> Result<(), Denial>;

    /// Releases the running slot and settles the reservation: `used_tokens` become
    /// usage, the rest of the reservation is freed. Idempotent per lease.
    async fn finish(
        &self,
        key: i64,
        lease: &Lease,
        grant: &Grant,
        used_tokens: u64,
    ) -> Result<(), Denial>;

    /// [`Limiter::finish`] for a settled request whose usage is `row` (its tokens are
    /// the used ones). A shared backend also journals the row until the ledger has it
    /// (see [`redis`]'s journal), so a replica that dies before its write-behind writer
    /// commits loses nothing the counters charged.
    async fn settle(
        &self,
        key: i64,
        lease: &Lease,
        grant: &Grant,
        row: &UsageRow,
    ) -> Result<(), Denial> {
        self.finish(key, lease, grant, row.prompt_tokens + row.completion_tokens)
            .await
    }

    /// Extends the leases of running slots and reservations (shared backends expire
    /// them so a crashed replica's slots come back).
    async fn renew(&self, key: i64, lease: &Lease) -> Result<(), Denial>;

    /// How often a running request must [`Limiter::renew`] its lease; `None` when
    /// leases never expire (one process).
    fn lease_renewal(&self) -> Option<Duration> {
        None
    }

    /// The key's used and reserved tokens for `month`.
    async fn usage(&self, key: i64, month: Month) -> Result<Usage, Denial>;

    /// Requests running and waiting for the key.
    async fn occupancy(&self, key: i64) -> Result<(u32, u32), Denial>;

    /// Whether the backend answers (for readiness). In-process counters always do.
    async fn ping(&self) -> Result<(), Denial> {
        Ok(())
    }

    /// Adds `mine`, the service this replica counted for `model`'s keys since the last
    /// exchange (key, weighted tokens over its share: the fleet queue's fair turns), to
    /// what all replicas counted, and returns every key's total. `None` from a backend
    /// of one process: there is no other replica to share with.
    async fn exchange_service(
        &self,
        model: &str,
        mine: &[(i64, f64)],
    ) -> Result<Option<Vec<(i64, f64)>>, Denial> {
        let _ = (model, mine);
        Ok(None)
    }
}

/// Where a limiter reads usage it has not counted itself (a new process, a Redis that
/// lost its data): the usage ledger.
#[async_trait]
pub trait UsageSource: Send + Sync + 'static {
    async fn month_usage(&self, key: i64, month: Month) -> Result<u64, String>;
}
