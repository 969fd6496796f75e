//! HTTP plumbing shared by every route: request ids and the error envelope,
//! authentication, body reading, fallbacks, panics answered, the request metadata record.

pub mod auth;
pub mod body;
pub mod connections;
pub mod envelope;
mod error_response;
pub mod every_request;
pub mod fallback;
pub mod openapi;
pub mod panics;
pub mod request_record;
pub mod request_span;
pub mod router;
pub mod routes;
