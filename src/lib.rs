//! fleetgate: a strict, metering HTTP gateway in front of a fleet of vLLM servers.

pub mod admin;
pub mod admission;
pub mod backoff;
mod batching;
pub mod completion;
pub mod config;
pub mod connections;
pub mod contract;
pub mod error;
pub mod fleet;
pub mod http;
pub mod keys;
pub mod ledger;
pub mod metrics;
pub mod models;
pub mod openapi;
pub mod ops;
pub mod reload;
pub mod request_log;
pub mod router;
pub mod server;
pub mod state;
pub mod store;
pub mod traces;
pub mod upstream;
pub mod usage;
pub mod workbench;
