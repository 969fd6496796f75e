//! API keys: the one service that creates, lists, finds, revokes and limits them and
//! reads their usage (`service`), used by both the admin API and the `fleetgate keys`
//! commands, and the in-memory table the request path authenticates against (`table`).
//! A key's secret and the check of a presented hash are `crate::key_secret`'s, the
//! bounds of its limits `crate::key_limits`'; whether a presented secret may be used
//! now (revoked, expired, a rotation's previous secret in or out of its grace) is
//! `check`'s.
//!
//! This file only declares and re-exports.

mod check;
mod service;
mod table;

pub use self::check::{Refusal, check};
pub use self::service::{
    DEFAULT_GRACE_SECS, IssuedKey, KeyError, KeyService, LimitsChange, MAX_EXPIRES_AT,
    MAX_GRACE_SECS, MonthUsage, NewLimits, check_expiry,
};
pub use self::table::{FOLLOW_EVERY, KeyTable, MISS_WAIT, PULL_TIMEOUT};
