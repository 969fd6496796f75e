//! `[jobs]`: completion jobs (`Prefer: respond-async`), their workers, long-polls and
//! retention.

use serde::Deserialize;

/// How jobs run and how long they are kept. The retention defaults are the contract's:
/// a queued job expires after 24 hours, content goes 24 hours after a job ends, the
/// row (dedup and accounting metadata) 7 days after.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSettings {
    /// Jobs this replica runs at once (0: it runs none, it only takes submissions).
    #[serde(default = "default_workers")]
    pub workers: u32,
    /// A claimed job's lease; renewed every third of it (at least every second) while it
    /// runs. A replica that dies holds its jobs this long before another takes them over.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// How often an idle worker looks for a job another replica queued (jobs queued
    /// here wake it at once).
    #[serde(default = "default_poll_interval_ms")]
    pub poll_interval_ms: u64,
    /// Runs of one job before it fails: every run started counts (one that never
    /// reached a node and is retried, one cut by a shutdown, one taken over after its
    /// replica died).
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// The longest a run may take upstream (a job has no client waiting on it, so the
    /// synchronous request window does not apply).
    #[serde(default = "default_run_timeout_ms")]
    pub run_timeout_ms: u64,
    /// Queued and running jobs a key may have; more submissions get 429 `queue_full`.
    #[serde(default = "default_max_pending_per_key")]
    pub max_pending_per_key: u32,
    /// Bytes of request bodies a key's queued and running jobs may hold; a submission
    /// that would go over gets 429 `queue_full` (retry once some have ended).
    #[serde(default = "default_max_pending_bytes_per_key")]
    pub max_pending_bytes_per_key: u64,
    /// Long-polls (`GET /v1/harvest/{id}?wait=`) waiting at once on this replica (at most
    /// 10,000), and per key; beyond them a harvest answers at once with
    /// `X-Acs-Longpoll: declined`.
    #[serde(default = "default_max_waiters")]
    pub max_waiters: u32,
    #[serde(default = "default_max_waiters_per_key")]
    pub max_waiters_per_key: u32,
    /// A job still queued this long after submission expires.
    #[serde(default = "default_day_ms")]
    pub queued_ttl_ms: u64,
    /// Request and result content is deleted this long after a job ends.
    #[serde(default = "default_day_ms")]
    pub content_ttl_ms: u64,
    /// The job's row goes this long after it ends (once its usage is in the ledger);
    /// an `Idempotency-Key` is remembered as long.
    #[serde(default = "default_week_ms")]
    pub metadata_ttl_ms: u64,
    /// How often the retention sweep runs.
    #[serde(default = "default_sweep_interval_ms")]
    pub sweep_interval_ms: u64,
}

impl Default for JobSettings {
    fn default() -> Self {
        Self {
            workers: default_workers(),
            lease_ms: default_lease_ms(),
            poll_interval_ms: default_poll_interval_ms(),
            max_attempts: default_max_attempts(),
            run_timeout_ms: default_run_timeout_ms(),
            max_pending_per_key: default_max_pending_per_key(),
            max_pending_bytes_per_key: default_max_pending_bytes_per_key(),
            max_waiters: default_max_waiters(),
            max_waiters_per_key: default_max_waiters_per_key(),
            queued_ttl_ms: default_day_ms(),
            content_ttl_ms: default_day_ms(),
            metadata_ttl_ms: default_week_ms(),
            sweep_interval_ms: default_sweep_interval_ms(),
        }
    }
}

/// The most long-polls one replica may hold: the jobs they wait for are looked up in one
/// statement, one bound parameter each (SQLite allows 32,766).
pub const MAX_WAITERS: u32 = 10_000;

impl JobSettings {
    /// The `*_ms` settings by name, for the config's bounds check.
    pub(super) fn durations(&self) -> [(&'static str, u64); 7] {
        [
            ("jobs.lease_ms", self.lease_ms),
            ("jobs.poll_interval_ms", self.poll_interval_ms),
            ("jobs.run_timeout_ms", self.run_timeout_ms),
            ("jobs.queued_ttl_ms", self.queued_ttl_ms),
            ("jobs.content_ttl_ms", self.content_ttl_ms),
            ("jobs.metadata_ttl_ms", self.metadata_ttl_ms),
            ("jobs.sweep_interval_ms", self.sweep_interval_ms),
        ]
    }
}

fn default_workers() -> u32 {
    8
}
fn default_lease_ms() -> u64 {
    30_000
}
fn default_poll_interval_ms() -> u64 {
    500
}
fn default_max_attempts() -> u32 {
    5
}
fn default_run_timeout_ms() -> u64 {
    3_600_000
}
fn default_max_pending_per_key() -> u32 {
    10_000
}
/// 1 GiB: 32 requests at the largest body (32 MiB), or 10,000 jobs of 100 kB — a
/// full queue of ordinary prompts, not 335 GB of huge ones.
fn default_max_pending_bytes_per_key() -> u64 {
    1 << 30
}
fn default_max_waiters() -> u32 {
    2_000
}
fn default_max_waiters_per_key() -> u32 {
    100
}
fn default_day_ms() -> u64 {
    24 * 3_600_000
}
fn default_week_ms() -> u64 {
    7 * 24 * 3_600_000
}
fn default_sweep_interval_ms() -> u64 {
    60_000
}
