//! fleetgate: a strict, metering HTTP gateway in front of a fleet of vLLM servers.

pub mod admission;
pub mod background;
pub mod backoff;
mod batching;
pub mod completion;
pub mod config;
pub mod contract;
pub mod error;
pub mod fleet;
pub mod http;
pub mod job_hub;
pub mod jobs;
pub mod key_limits;
pub mod key_secret;
pub mod keys;
pub mod ledger;
mod log_writer;
pub mod metrics;
pub mod reload;
pub mod request_log;
pub mod request_record;
pub mod server;
pub mod state;
pub mod store;
pub mod traces;
pub mod upstream;
pub mod wire;
