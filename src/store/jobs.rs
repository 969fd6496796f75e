//! The records of completion jobs (`jobs` table, migration 0004) and the [`JobStore`]
//! trait both backends implement. What a job is and how it runs is `crate::jobs`; this is
//! only how it is kept.

use super::records::{StoreError, UsageRow};

/// Where a job is in its life. `queued → running → succeeded | failed`; `queued →
/// expired | cancelled`; `running → cancelled`. A running job whose lease lapses is
/// taken over as a new attempt (still running); one whose run never reached a node, or
/// was cut by a shutdown, goes back to queued.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    Queued,
    Running,
    Succeeded,
    Failed,
    Expired,
    Cancelled,
}

impl JobStatus {
    pub const ALL: [Self; 6] = [
        Self::Queued,
        Self::Running,
        Self::Succeeded,
        Self::Failed,
        Self::Expired,
        Self::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Expired => "expired",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Whether the job has ended (it changes no more).
    pub fn is_terminal(self) -> bool {
        !matches!(self, Self::Queued | Self::Running)
    }
}

/// A job to insert.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub id: String,
    pub key_id: i64,
    pub model: String,
    pub idempotency_key: Option<String>,
    /// SHA-256 of the request body: what an idempotent retry must match.
    pub request_hash: Vec<u8>,
    pub request: Vec<u8>,
    pub created_at_ms: i64,
    /// When a job still queued then expires.
    pub expires_at_ms: i64,
}

/// What [`JobStore::insert`] did.
#[derive(Debug, Clone)]
pub enum Inserted {
    Created(JobRow),
    /// The key already has a job under this idempotency key (whatever its body).
    Existing(JobRow),
}

/// One row of `jobs`.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct JobRow {
    pub id: String,
    pub key_id: i64,
    pub model: String,
    pub status: String,
    pub idempotency_key: Option<String>,
    pub request_hash: Vec<u8>,
    /// `None` once content is deleted (retention).
    pub request: Option<Vec<u8>>,
    /// The body a synchronous call would have got: vLLM's response, or the error
    /// envelope. `None` until the job ends, and once content is deleted.
    pub result: Option<Vec<u8>>,
    /// The HTTP status of `result`.
    pub result_status: Option<i64>,
    pub error_code: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    /// Runs started (claims); the fencing number of the current one.
    pub attempts: i64,
    pub lease_owner: Option<String>,
    pub lease_until_ms: Option<i64>,
    pub run_after_ms: i64,
    pub cancel_requested: i64,
    pub created_at_ms: i64,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub expires_at_ms: i64,
}

impl JobRow {
    /// The status column (a value this code wrote; an unknown one reads as failed).
    pub fn status(&self) -> JobStatus {
        JobStatus::parse(&self.status).unwrap_or(JobStatus::Failed)
    }
}

/// How a run of a job ended, for [`JobStore::finish`].
#[derive(Debug, Clone)]
pub struct JobOutcome {
    pub status: JobStatus,
    pub result: Option<Vec<u8>>,
    pub result_status: Option<u16>,
    pub error_code: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// The usage to put in the ledger with the end, in the same transaction, under the
    /// job's id, replacing any row under that id: what a run cut short or refused before
    /// it had a node recorded there is replaced by the charge of the run that ended the
    /// job, and a job that ended is charged even if the process dies before its
    /// write-behind ledger row is committed (that row, under the same id, then changes
    /// nothing).
    pub charge: Option<UsageRow>,
}

/// What a key's queued and running jobs hold: how many, and their request bodies' bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pending {
    pub jobs: u64,
    pub bytes: u64,
}

/// The page of jobs [`JobStore::list`] returns: newest first.
#[derive(Debug, Clone, Default)]
pub struct JobQuery {
    /// Only this key's jobs (`None`: every key's, for the operator).
    pub key_id: Option<i64>,
    pub status: Option<JobStatus>,
    /// Only jobs older than this one (the last id of the previous page).
    pub after: Option<String>,
    pub limit: u32,
}

/// The retention rules at `now_ms` (see the `[jobs]` config).
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    pub now_ms: i64,
    /// Request and result content goes this long after the job ends.
    pub content_ttl_ms: i64,
    /// The row goes this long after the job ends (its accounting is settled when it
    /// ends).
    pub metadata_ttl_ms: i64,
}

/// What a sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    pub expired: u64,
    pub purged: u64,
    pub deleted: u64,
}

/// The ids of jobs as they end, announced by the backend; ends when its connection is
/// lost.
pub type JobEnds = std::pin::Pin<Box<dyn futures_util::Stream<Item = String> + Send>>;

/// Durable jobs. Every state change of a running job is fenced by the attempt that
/// claimed it: it takes effect only while the job is still running under that attempt.
#[async_trait::async_trait]
pub trait JobStore: Send + Sync + 'static {
    /// Inserts a job, or returns the key's job under the same idempotency key.
    async fn insert(&self, job: &NewJob) -> Result<Inserted, StoreError>;

    /// The key's job submitted under `idempotency_key`.
    async fn by_idempotency_key(
        &self,
        key_id: i64,
        idempotency_key: &str,
    ) -> Result<Option<JobRow>, StoreError>;

    /// The key's job `id`; another key's is `None`.
    async fn job(&self, key_id: i64, id: &str) -> Result<Option<JobRow>, StoreError>;

    /// Any key's job `id` (the operator's CLI).
    async fn any_job(&self, id: &str) -> Result<Option<JobRow>, StoreError>;

    /// A page of jobs, newest first, without their content: no `request`, and a
    /// `result` only for a failed job (its error envelope).
    async fn list(&self, query: &JobQuery) -> Result<Vec<JobRow>, StoreError>;

    /// The key's queued and running jobs.
    async fn pending(&self, key_id: i64) -> Result<Pending, StoreError>;

    /// Takes the oldest runnable job — queued and due, or running under a lease that
    /// lapsed before `now_ms` — as a new attempt leased to `owner` until `now_ms +
    /// lease_ms`. Two claimers never get the same attempt.
    async fn claim(
        &self,
        owner: &str,
        now_ms: i64,
        lease_ms: i64,
    ) -> Result<Option<JobRow>, StoreError>;

    /// Extends the lease of `attempt`; `None` when the attempt no longer holds the job
    /// (its lease lapsed and another took it), else whether a cancel was asked for.
    async fn renew(
        &self,
        id: &str,
        attempt: i64,
        until_ms: i64,
    ) -> Result<Option<bool>, StoreError>;

    /// Ends the job under `attempt`; false when the attempt no longer holds it.
    async fn finish(
        &self,
        id: &str,
        attempt: i64,
        outcome: &JobOutcome,
        now_ms: i64,
    ) -> Result<bool, StoreError>;

    /// Puts the job back in the queue, due at `run_after_ms` — or ends it `cancelled` at
    /// `now_ms` when a cancel was asked for meanwhile; false when the attempt no longer
    /// holds it.
    async fn requeue(
        &self,
        id: &str,
        attempt: i64,
        run_after_ms: i64,
        now_ms: i64,
    ) -> Result<bool, StoreError>;

    /// Cancels the key's job: a queued one at once; a running one is marked for its
    /// worker to stop. Returns the row after the change (`None`: no such job of the key).
    async fn cancel(
        &self,
        key_id: i64,
        id: &str,
        now_ms: i64,
    ) -> Result<Option<JobRow>, StoreError>;

    /// The ids of jobs as they end on any replica, for a backend that announces them
    /// (PostgreSQL: `NOTIFY fleetgate_jobs` in the transaction that ends a job); `None`:
    /// look them up with [`JobStore::ended`] (SQLite, or the database cannot be reached
    /// now).
    async fn job_end_signals(&self) -> Option<JobEnds> {
        None
    }

    /// Which of `ids` have ended.
    async fn ended(&self, ids: &[String]) -> Result<Vec<String>, StoreError>;

    /// Jobs per status, for the metrics.
    async fn status_counts(&self) -> Result<Vec<(JobStatus, u64)>, StoreError>;

    /// Applies the retention rules: expires queued jobs past their expiry, deletes
    /// content and then rows of ended jobs.
    async fn sweep(&self, retention: Retention) -> Result<Swept, StoreError>;
}
