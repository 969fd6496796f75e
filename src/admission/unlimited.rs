//! Limits off (`limits.enabled = false`): every request starts at once with its full
//! `max_tokens`; usage is still metered into the ledger, and read back from it.

use std::sync::Arc;

use async_trait::async_trait;

use super::{Admitted, Cost, Denial, Grant, KeyLimits, Lease, Limiter, Month, Usage, UsageSource};

pub struct Unlimited {
    ledger: Arc<dyn UsageSource>,
}

impl Unlimited {
    pub fn new(ledger: Arc<dyn UsageSource>) -> Self {
        Self { ledger }
    }
}

#[async_trait]
impl Limiter for Unlimited {
    async fn admit(
        &self,
        _: i64,
        _: &KeyLimits,
        cost: &Cost,
        _: &Lease,
    ) -> Result<Admitted, Denial> {
        Ok(Admitted::Running(full_grant(cost)))
    }

    /// Nothing is ever refused.
    async fn peek(&self, _: i64, _: &KeyLimits) -> Result<(), Denial> {
        Ok(())
    }

    async fn count_start(&self, _: i64, _: u32) -> Result<(), Denial> {
        Ok(())
    }

    /// Never reached: nothing queues.
    async fn wait_turn(
        &self,
        _: i64,
        _: &KeyLimits,
        cost: &Cost,
        _: &Lease,
    ) -> Result<Grant, Denial> {
        Ok(full_grant(cost))
    }

    async fn leave(&self, _: i64, _: &Lease) -> Result<(), Denial> {
        Ok(())
    }

    async fn finish(&self, _: i64, _: &Lease, _: &Grant, _: u64) -> Result<(), Denial> {
        Ok(())
    }

    async fn renew(&self, _: i64, _: &Lease) -> Result<(), Denial> {
        Ok(())
    }

    async fn usage(&self, key: i64, month: Month) -> Result<Usage, Denial> {
        let used = self
            .ledger
            .month_usage(key, month)
            .await
            .map_err(Denial::Unavailable)?;
        Ok(Usage { used, reserved: 0 })
    }

    async fn occupancy(&self, _: i64) -> Result<(u32, u32), Denial> {
        Ok((0, 0))
    }
}

fn full_grant(cost: &Cost) -> Grant {
    Grant {
        max_tokens: cost.max_tokens,
        reserved: cost.worst_case(),
        month: Month::now(),
    }
}
