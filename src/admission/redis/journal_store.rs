//! The usage journal's steps (`journal.rs`) as Redis commands, on the shared limiter's
//! connection and under its key prefix: the journal lives beside the counters that
//! `finish.lua` charges in the same step as it journals a row.

use async_trait::async_trait;

use super::journal::{self, JournalStore};
use super::limiter::RedisLimiter;
use crate::admission::Denial;

#[async_trait]
impl JournalStore for RedisLimiter {
    async fn beat(&self) -> Result<(), Denial> {
        let mut set = ::redis::cmd("SET");
        set.arg(self.journal.alive(&self.journal.writer))
            .arg(1)
            .arg("PX")
            .arg(journal::ALIVE_TTL.as_millis() as u64);
        self.connections
            .call("journal heartbeat", |mut c| async move {
                set.query_async::<()>(&mut c).await
            })
            .await
    }

    async fn writers(&self) -> Result<Vec<String>, Denial> {
        let mut members = ::redis::cmd("SMEMBERS");
        members.arg(&self.journal.writers);
        self.connections
            .call("journal writers", |mut c| async move {
                members.query_async(&mut c).await
            })
            .await
    }

    async fn adopt_from(&self, writer: &str) -> Result<Vec<String>, Denial> {
        let mut step = self.journal.adopt_script().prepare_invoke();
        step.key(self.journal.journal_of(writer))
            .key(&self.journal.own)
            .key(&self.journal.writers)
            .key(self.journal.alive(writer))
            .arg(writer)
            .arg(&self.journal.writer)
            .arg(journal::ADOPT_BATCH);
        self.connections
            .call("journal adopt", |mut c| async move {
                step.invoke_async(&mut c).await
            })
            .await
    }

    async fn scan_own(&self, cursor: u64) -> Result<(u64, Vec<String>), Denial> {
        let mut scan = ::redis::cmd("HSCAN");
        scan.arg(&self.journal.own)
            .arg(cursor)
            .arg("COUNT")
            .arg(journal::ADOPT_BATCH);
        self.connections
            .call("journal sweep", |mut c| async move {
                scan.query_async(&mut c).await
            })
            .await
    }

    async fn forget(&self, request_ids: Vec<String>) -> Result<(), Denial> {
        let mut hdel = ::redis::cmd("HDEL");
        hdel.arg(&self.journal.own).arg(&request_ids);
        self.connections
            .call("journal forget", |mut c| async move {
                hdel.query_async::<u64>(&mut c).await
            })
            .await
            .map(drop)
    }

    fn writer(&self) -> &str {
        &self.journal.writer
    }
}
