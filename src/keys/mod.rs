//! API keys: the one service that creates, lists, finds, revokes and limits them and
//! reads their usage (`service`), used by both the admin API and the `fleetgate keys`
//! commands, and the in-memory table the request path authenticates against (`table`).
//! A key's secret and the check of a presented one are `crate::key_secret`'s, the
//! bounds of its limits `crate::key_limits`'.
//!
//! This file only declares and re-exports.

mod service;
mod table;

pub use self::service::{IssuedKey, KeyError, KeyService, LimitsChange, MonthUsage, NewLimits};
pub use self::table::{FOLLOW_EVERY, KeyTable, MISS_WAIT, PULL_TIMEOUT};
