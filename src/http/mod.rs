//! HTTP plumbing shared by every route: request ids and the error envelope,
//! authentication, body reading, fallbacks.

pub mod auth;
pub mod body;
pub mod envelope;
pub mod fallback;
