//! The journal: usage that the live counters have charged but the store may not have
//! yet. The ledger's write-behind writer commits a settled row within milliseconds —
//! but a replica killed in those milliseconds would take the row with it, while Redis
//! has already counted it and the client has been told. So the settlement script
//! (`finish.lua`) also journals the row, in the same atomic step that charges it, under
//! the replica's writer id; the writer tells the journal once the store has the row
//! ([`Committed`]), and the row is forgotten. A replica that dies leaves its journal
//! behind, and a live replica adopts it: moves the rows into its own journal and hands
//! them to its own writer (rows are idempotent on their request id, so a row that did
//! reach the store is not counted twice).
//!
//! | key | type | content |
//! | --- | --- | --- |
//! | `P:unwritten:<writer>` | hash | request id → `"key_id month prompt completion created_at"` |
//! | `P:writers` | set | writers that have journaled rows |
//! | `P:alive:<writer>` | string | present while the writer's process lives ([`ALIVE_TTL`]) |
//!
//! What it does not cover: a replica and Redis lost together (Redis keeps nothing on
//! disk here), and a row whose settlement never reached Redis before the replica died
//! (then the counters never charged it either).

use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::Script;
use async_trait::async_trait;

use crate::admission::Denial;
use crate::ledger::{Committed, FLUSH_WAIT, Ledger};
use crate::store::{UsageRow, now_unix};

/// How often a live replica says so.
const BEAT_EVERY: Duration = Duration::from_secs(2);
/// How long a replica counts as alive after it last said so; then its journal is
/// adopted.
pub const ALIVE_TTL: Duration = Duration::from_secs(10);
/// How often the other replicas' liveness is checked.
const ADOPT_EVERY: Duration = Duration::from_secs(5);
/// How often the replica's own journal is swept of rows whose commit report was lost
/// (a Redis that did not answer then).
const SWEEP_EVERY: Duration = Duration::from_secs(60);
/// How old (seconds) a row of the replica's own journal must be for the sweep to offer
/// it to the ledger again.
const SWEEP_AGE: i64 = 30;
/// Rows moved per adoption step.
pub const ADOPT_BATCH: usize = 500;

/// The journal's steps against Redis (the shared limiter's connection).
#[async_trait]
pub trait JournalStore: Send + Sync + 'static {
    /// Says this replica is alive for [`ALIVE_TTL`] more.
    async fn beat(&self) -> Result<(), Denial>;
    /// The writers that have journaled rows.
    async fn writers(&self) -> Result<Vec<String>, Denial>;
    /// Moves up to [`ADOPT_BATCH`] rows of `writer` into this replica's journal, unless
    /// `writer` is alive; returns them (`[request_id, row, …]`, empty when none).
    async fn adopt_from(&self, writer: &str) -> Result<Vec<String>, Denial>;
    /// One `HSCAN` step over this replica's own journal: the next cursor and the
    /// entries (`[request_id, row, …]`).
    async fn scan_own(&self, cursor: u64) -> Result<(u64, Vec<String>), Denial>;
    /// Removes rows from this replica's own journal.
    async fn forget(&self, request_ids: Vec<String>) -> Result<(), Denial>;
    /// This replica's writer id.
    fn writer(&self) -> &str;
}

/// The journal's Redis keys, as seen by one replica.
pub struct JournalKeys {
    /// This replica's writer id.
    pub writer: String,
    /// This replica's journal.
    pub own: String,
    pub writers: String,
    prefix: String,
    adopt: Script,
}

impl JournalKeys {
    pub fn new(prefix: &str) -> Self {
        let writer = uuid::Uuid::new_v4().simple().to_string();
        Self {
            own: format!("{prefix}:unwritten:{writer}"),
            writers: format!("{prefix}:writers"),
            writer,
            prefix: prefix.to_owned(),
            adopt: Script::new(include_str!("adopt.lua")),
        }
    }

    pub fn journal_of(&self, writer: &str) -> String {
        format!("{}:unwritten:{writer}", self.prefix)
    }

    pub fn alive(&self, writer: &str) -> String {
        format!("{}:alive:{writer}", self.prefix)
    }

    /// `adopt.lua`.
    pub fn adopt_script(&self) -> &Script {
        &self.adopt
    }
}

/// A row as the journal keeps it (the request id is the hash field).
pub fn encode(row: &UsageRow) -> String {
    format!(
        "{} {} {} {} {}",
        row.key_id, row.month, row.prompt_tokens, row.completion_tokens, row.created_at
    )
}

fn decode(request_id: String, value: &str) -> Option<UsageRow> {
    let mut parts = value.split(' ');
    let row = UsageRow {
        key_id: parts.next()?.parse().ok()?,
        month: parts.next()?.to_owned(),
        prompt_tokens: parts.next()?.parse().ok()?,
        completion_tokens: parts.next()?.parse().ok()?,
        created_at: parts.next()?.parse().ok()?,
        request_id,
    };
    parts.next().is_none().then_some(row)
}

/// Rows from a `[field, value, …]` reply; a malformed entry (not written by this
/// version) is skipped.
fn rows(entries: Vec<String>) -> Vec<UsageRow> {
    let mut rows = Vec::with_capacity(entries.len() / 2);
    let mut entries = entries.into_iter();
    while let (Some(request_id), Some(value)) = (entries.next(), entries.next()) {
        match decode(request_id, &value) {
            Some(row) => rows.push(row),
            None => tracing::warn!("usage journal: skipping an entry it cannot read"),
        }
    }
    rows
}

/// Forgets committed rows from the replica's own journal (the ledger's [`Committed`]).
pub struct Forget(pub Weak<dyn JournalStore>);

impl Committed for Forget {
    fn committed(&self, request_ids: Vec<String>) {
        let Some(journal) = self.0.upgrade() else {
            return;
        };
        // Not awaited by the writer: a Redis that stalls must not hold back the
        // ledger. A report that fails leaves rows the sweep finds.
        tokio::spawn(async move {
            if let Err(err) = journal.forget(request_ids).await {
                tracing::debug!(error = %err, "usage journal: could not forget committed rows");
            }
        });
    }
}

/// Keeps the journal for as long as the limiter lives: says this replica is alive,
/// adopts the journals of replicas that are not, and sweeps its own.
pub async fn tend(journal: Weak<dyn JournalStore>, ledger: Ledger) {
    let mut beat = tokio::time::interval(BEAT_EVERY);
    let mut adopt = tokio::time::interval(ADOPT_EVERY);
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.tick().await;
    loop {
        tokio::select! {
            _ = beat.tick() => {
                let Some(journal) = journal.upgrade() else { return };
                if let Err(err) = journal.beat().await {
                    tracing::debug!(error = %err, "usage journal: heartbeat failed");
                }
            }
            _ = adopt.tick() => {
                let Some(journal) = journal.upgrade() else { return };
                if let Err(err) = adopt_orphans(journal.as_ref(), &ledger).await {
                    tracing::debug!(error = %err, "usage journal: adoption failed");
                }
            }
            _ = sweep.tick() => {
                let Some(journal) = journal.upgrade() else { return };
                if let Err(err) = sweep_own(journal.as_ref(), &ledger).await {
                    tracing::debug!(error = %err, "usage journal: sweep failed");
                }
            }
        }
    }
}

/// Moves the rows of every writer that is no longer alive into this replica's journal
/// and hands them to its ledger writer.
async fn adopt_orphans(journal: &dyn JournalStore, ledger: &Ledger) -> Result<(), Denial> {
    for writer in journal.writers().await? {
        if writer == journal.writer() {
            continue;
        }
        let mut adopted = 0;
        // A closing ledger takes no more rows; they stay for another replica.
        while !ledger.is_closing() {
            let entries = journal.adopt_from(&writer).await?;
            if entries.is_empty() {
                break;
            }
            for row in rows(entries) {
                adopted += 1;
                ledger.record(row);
            }
        }
        if adopted > 0 {
            tracing::info!(
                rows = adopted,
                "usage journal: adopted the uncommitted usage rows of a replica that stopped"
            );
        }
    }
    Ok(())
}

/// Rows in this replica's own journal that its writer has committed, or never got,
/// but whose report did not reach Redis: once the ledger is flushed, every row still
/// journaled (and old enough not to be on its way) is offered to it again — a no-op for
/// the committed ones — and is forgotten when the writer reports it.
async fn sweep_own(journal: &dyn JournalStore, ledger: &Ledger) -> Result<(), Denial> {
    if !ledger.flush_within(FLUSH_WAIT).await || ledger.is_closing() {
        return Ok(());
    }
    let mut cursor = 0u64;
    loop {
        let (next, entries) = journal.scan_own(cursor).await?;
        let settled_before = now_unix() - SWEEP_AGE;
        for row in rows(entries) {
            // Younger rows may still be on their way through the writer.
            if row.created_at < settled_before {
                ledger.record(row);
            }
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The ledger's listener for a journal.
pub fn forget(journal: Weak<dyn JournalStore>) -> Arc<dyn Committed> {
    Arc::new(Forget(journal))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_reads_back_as_it_was_journaled() {
        let row = UsageRow {
            key_id: 42,
            request_id: "0193-abc".to_owned(),
            month: "2026-12".to_owned(),
            prompt_tokens: 7,
            completion_tokens: 1234,
            created_at: 1_780_000_000,
        };
        assert_eq!(
            decode(row.request_id.clone(), &encode(&row)),
            Some(row.clone())
        );
        assert_eq!(decode("x".to_owned(), "42 2026-12 7"), None);
        assert_eq!(decode("x".to_owned(), &format!("{} 9", encode(&row))), None);
    }
}
