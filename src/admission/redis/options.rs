//! The shared limiter's tuning: its leases, its calls' time bounds and how often a
//! waiter looks again; read by the limiter, its connections and its wake-ups alike.

use std::time::Duration;

/// Tuning of [`RedisLimiter`](super::RedisLimiter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisLimiterOptions {
    /// How long a running slot outlives its last renewal (renewed every third of it).
    /// Its reservation outlives it by two minutes more, for a late settlement.
    pub lease_ttl: Duration,
    /// How long a queue place outlives its waiter's last check; a waiter checks at
    /// least every quarter of it, so a crashed replica's places are gone within this.
    pub queue_ttl: Duration,
    /// Longest wait for one Redis reply.
    pub call_timeout: Duration,
    /// Longest wait for a connection to Redis.
    pub connect_timeout: Duration,
    /// How often a waiter re-checks its turn without a wake-up message.
    pub poll_interval: Duration,
}

impl Default for RedisLimiterOptions {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(2),
            queue_ttl: Duration::from_secs(2),
            call_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(1),
            poll_interval: Duration::from_millis(250),
        }
    }
}
