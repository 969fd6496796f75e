//! API keys: their secrets (`secret`) and the bounds of their limits (`limits`).
//!
//! This file only declares and re-exports.

mod limits;
mod secret;

pub use self::limits::{InvalidLimit, Limit, LimitInput};
pub use self::secret::{
    NewKey, PREFIX_LEN, SECRET_LEN, SECRET_PREFIX, Secret, generate, hash_secret, parse_bearer,
    verify,
};
