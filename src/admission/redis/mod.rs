//! The shared limiter: the counters live in Redis, so every gateway replica enforces one
//! set of limits per key. Same semantics as [`LocalLimiter`](super::local::LocalLimiter).
//!
//! - `limiter.rs`: [`RedisLimiter`], each decision one Lua script (`*.lua` here, sharing
//!   `common.lua`); the data layout, the leases, the cost and the failures are told there;
//! - `connection.rs`: its connections to Redis, one of each kind per runtime, every call
//!   bounded in time (the scripts run on the lean RESP client in `wire::resp`);
//! - `wakeups.rs`: a key's local waiters woken when a slot frees on any replica;
//! - `journal.rs`: settled usage kept in Redis until the ledger has it;
//!   `journal_store.rs`: the journal's steps as Redis commands;
//! - `options.rs`: [`RedisLimiterOptions`].

mod connection;
pub mod journal;
mod journal_store;
mod limiter;
mod options;
mod wakeups;

pub use connection::InvalidRedisUrl;
pub use limiter::{COUNTER_TTL_PAST_MONTH, LAPSED_KEEP, RedisClusterRefused, RedisLimiter};
pub use options::RedisLimiterOptions;
