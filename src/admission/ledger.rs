//! The usage ledger (in the store) as the limiters' source of usage recorded before they
//! started counting.

use std::sync::Arc;

use async_trait::async_trait;

use super::{Month, UsageSource};
use crate::store::Store;

pub struct LedgerUsage(pub Arc<dyn Store>);

#[async_trait]
impl UsageSource for LedgerUsage {
    async fn month_usage(&self, key: i64, month: Month) -> Result<u64, String> {
        self.0
            .month_usage(key, &month.to_string())
            .await
            .map_err(|err| format!("{err:#}"))
    }
}
