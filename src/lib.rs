//! fleetgate: a strict, metering HTTP gateway in front of a fleet of vLLM servers.

pub mod completion;
pub mod error;
pub mod keys;
pub mod mock_vllm;
pub mod store;
