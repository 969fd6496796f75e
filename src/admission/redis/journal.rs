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

use super::RedisLimiter;
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
const ADOPT_BATCH: usize = 500;

/// The journal's Redis keys, as seen by one replica.
pub(super) struct JournalKeys {
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

    fn journal_of(&self, writer: &str) -> String {
        format!("{}:unwritten:{writer}", self.prefix)
    }

    fn alive(&self, writer: &str) -> String {
        format!("{}:alive:{writer}", self.prefix)
    }
}

/// A row as the journal keeps it (the request id is the hash field).
pub(super) fn encode(row: &UsageRow) -> String {
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
pub struct Forget(pub Weak<RedisLimiter>);

impl Committed for Forget {
    fn committed(&self, request_ids: Vec<String>) {
        let Some(limiter) = self.0.upgrade() else {
            return;
        };
        // Not awaited by the writer: a Redis that stalls must not hold back the
        // ledger. A report that fails leaves rows the sweep finds.
        tokio::spawn(async move {
            let mut hdel = ::redis::cmd("HDEL");
            hdel.arg(&limiter.journal.own).arg(&request_ids);
            let forgot = limiter
                .call("journal forget", |mut c| async move {
                    hdel.query_async::<u64>(&mut c).await
                })
                .await;
            if let Err(err) = forgot {
                tracing::debug!(error = %err, "usage journal: could not forget committed rows");
            }
        });
    }
}

/// Keeps the journal for as long as the limiter lives: says this replica is alive,
/// adopts the journals of replicas that are not, and sweeps its own.
pub async fn tend(limiter: Weak<RedisLimiter>, ledger: Ledger) {
    let mut beat = tokio::time::interval(BEAT_EVERY);
    let mut adopt = tokio::time::interval(ADOPT_EVERY);
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.tick().await;
    loop {
        tokio::select! {
            _ = beat.tick() => {
                let Some(limiter) = limiter.upgrade() else { return };
                if let Err(err) = limiter.beat().await {
                    tracing::debug!(error = %err, "usage journal: heartbeat failed");
                }
            }
            _ = adopt.tick() => {
                let Some(limiter) = limiter.upgrade() else { return };
                if let Err(err) = limiter.adopt_orphans(&ledger).await {
                    tracing::debug!(error = %err, "usage journal: adoption failed");
                }
            }
            _ = sweep.tick() => {
                let Some(limiter) = limiter.upgrade() else { return };
                if let Err(err) = limiter.sweep(&ledger).await {
                    tracing::debug!(error = %err, "usage journal: sweep failed");
                }
            }
        }
    }
}

impl RedisLimiter {
    async fn beat(&self) -> Result<(), Denial> {
        let mut set = ::redis::cmd("SET");
        set.arg(self.journal.alive(&self.journal.writer))
            .arg(1)
            .arg("PX")
            .arg(ALIVE_TTL.as_millis() as u64);
        self.call("journal heartbeat", |mut c| async move {
            set.query_async::<()>(&mut c).await
        })
        .await
    }

    /// Moves the rows of every writer that is no longer alive into this replica's
    /// journal and hands them to its ledger writer.
    async fn adopt_orphans(&self, ledger: &Ledger) -> Result<(), Denial> {
        let writers: Vec<String> = {
            let mut members = ::redis::cmd("SMEMBERS");
            members.arg(&self.journal.writers);
            self.call("journal writers", |mut c| async move {
                members.query_async(&mut c).await
            })
            .await?
        };
        for writer in writers.iter().filter(|w| **w != self.journal.writer) {
            let mut adopted = 0;
            // A closing ledger takes no more rows; they stay for another replica.
            while !ledger.is_closing() {
                let mut step = self.journal.adopt.prepare_invoke();
                step.key(self.journal.journal_of(writer))
                    .key(&self.journal.own)
                    .key(&self.journal.writers)
                    .key(self.journal.alive(writer))
                    .arg(writer)
                    .arg(&self.journal.writer)
                    .arg(ADOPT_BATCH);
                let entries: Vec<String> = self
                    .call("journal adopt", |mut c| async move {
                        step.invoke_async(&mut c).await
                    })
                    .await?;
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
    /// journaled is offered to it again (a no-op for the committed ones), and is
    /// forgotten when the writer reports it.
    async fn sweep(&self, ledger: &Ledger) -> Result<(), Denial> {
        if !ledger.flush_within(FLUSH_WAIT).await || ledger.is_closing() {
            return Ok(());
        }
        let mut cursor = 0u64;
        loop {
            let mut scan = ::redis::cmd("HSCAN");
            scan.arg(&self.journal.own)
                .arg(cursor)
                .arg("COUNT")
                .arg(ADOPT_BATCH);
            let (next, entries): (u64, Vec<String>) = self
                .call("journal sweep", |mut c| async move {
                    scan.query_async(&mut c).await
                })
                .await?;
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
}

/// The ledger's listener for a shared limiter.
pub fn forget(limiter: &Arc<RedisLimiter>) -> Arc<dyn Committed> {
    Arc::new(Forget(Arc::downgrade(limiter)))
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
