//! API keys: the one service that creates, lists, finds, revokes and limits them and
//! reads their usage (`service`), used by both the admin API and the `fleetgate keys`
//! commands, the in-memory table the request path authenticates against (`table`), and
//! the check of a presented secret (`bearer`). A key's secret itself is
//! `crate::key_secret`'s, the bounds of its limits `crate::key_limits`'.
//!
//! This file only declares and re-exports.

mod bearer;
mod service;
mod table;

pub use self::bearer::{parse_bearer, verify};
pub use self::service::{IssuedKey, KeyError, KeyService, LimitsChange, MonthUsage, NewLimits};
pub use self::table::{FOLLOW_EVERY, KeyTable, MISS_WAIT, PULL_TIMEOUT};
