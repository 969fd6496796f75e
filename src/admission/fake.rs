//! A shared backend for the admission module's own tests: down until told it is up,
//! recording the calls the background tasks make (give-back and renewals).

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{Admitted, Cost, Denial, Grant, KeyLimits, Lease, Limiter, Month, Usage};

/// How often the fake asks for its leases to be renewed.
pub const RENEWAL: Duration = Duration::from_millis(600);

#[derive(Default)]
pub struct Backend {
    /// Whether `leave` and `renew` succeed; every other step fails.
    pub up: AtomicBool,
    /// The leases `leave` was called for, in order.
    pub attempts: Mutex<Vec<String>>,
    /// The leases `finish` was called for.
    pub given_back: Mutex<HashSet<String>>,
    /// Each `renew`: which lease, when.
    pub renewed: Mutex<Vec<(String, Instant)>>,
}

impl Backend {
    /// When `lease` was renewed, in order.
    pub fn renewals_of(&self, lease: &str) -> Vec<Instant> {
        let renewed = self.renewed.lock().unwrap();
        renewed
            .iter()
            .filter(|(l, _)| l == lease)
            .map(|(_, at)| *at)
            .collect()
    }

    fn answer(&self) -> Result<(), Denial> {
        if self.up.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(down())
        }
    }
}

fn down() -> Denial {
    Denial::Unavailable("down".to_owned())
}

#[async_trait]
impl Limiter for Backend {
    async fn admit(&self, _: i64, _: &KeyLimits, _: &Cost, _: &Lease) -> Result<Admitted, Denial> {
        Err(down())
    }
    async fn peek(&self, _: i64, _: &KeyLimits) -> Result<(), Denial> {
        Err(down())
    }
    async fn wait_turn(&self, _: i64, _: &KeyLimits, _: &Cost, _: &Lease) -> Result<Grant, Denial> {
        Err(down())
    }
    async fn count_start(&self, _: i64, _: u32) -> Result<(), Denial> {
        Err(down())
    }
    async fn leave(&self, _: i64, lease: &Lease) -> Result<(), Denial> {
        self.attempts.lock().unwrap().push(lease.to_owned());
        self.answer()
    }
    async fn finish(&self, _: i64, lease: &Lease, _: &Grant, _: u64) -> Result<(), Denial> {
        self.given_back.lock().unwrap().insert(lease.to_owned());
        Ok(())
    }
    async fn renew(&self, _: i64, lease: &Lease) -> Result<(), Denial> {
        self.renewed
            .lock()
            .unwrap()
            .push((lease.to_owned(), Instant::now()));
        self.answer()
    }
    fn lease_renewal(&self) -> Option<Duration> {
        Some(RENEWAL)
    }
    async fn usage(&self, _: i64, _: Month) -> Result<Usage, Denial> {
        Err(down())
    }
    async fn occupancy(&self, _: i64) -> Result<(u32, u32), Denial> {
        Err(down())
    }
}
