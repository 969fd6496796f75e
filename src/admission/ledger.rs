//! The usage ledger (in the store) as the limiters' source of usage recorded before they
//! started counting.

use std::sync::Arc;

use async_trait::async_trait;

use super::{Month, UsageSource};
use crate::ledger::{FLUSH_WAIT, Ledger};
use crate::store::Store;

/// Reads the ledger's sum after committing this process's own rows still waiting in
/// the write-behind writer, so that a counter seeded from it misses none of them.
pub struct LedgerUsage {
    pub store: Arc<dyn Store>,
    pub writer: Ledger,
}

#[async_trait]
impl UsageSource for LedgerUsage {
    async fn month_usage(&self, key: i64, month: Month) -> Result<u64, String> {
        if !self.writer.flush_within(FLUSH_WAIT).await {
            // Rows of this process not yet in the ledger would be missing from its sum.
            return Err("the usage ledger's writer could not commit in time".to_owned());
        }
        self.store
            .month_usage(key, &month.to_string())
            .await
            .map_err(|err| format!("{err:#}"))
    }
}
