//! API keys: their secrets (`secret`), the bounds of their limits (`limits`) and the one
//! service that creates, lists, finds, revokes and limits them and reads their usage
//! (`service`), used by both the admin API and the `fleetgate keys` commands, and the
//! in-memory table the request path authenticates against (`table`).
//!
//! This file only declares and re-exports.

mod limits;
mod secret;
mod service;
mod table;

pub use self::limits::{InvalidLimit, Limit, LimitInput};
pub use self::secret::{
    NewKey, PREFIX_LEN, SECRET_LEN, SECRET_PREFIX, Secret, generate, hash_secret, parse_bearer,
    verify,
};
pub use self::service::{IssuedKey, KeyError, KeyService, LimitsChange, MonthUsage, NewLimits};
pub use self::table::{FOLLOW_EVERY, KeyTable, MISS_WAIT, PULL_TIMEOUT};
