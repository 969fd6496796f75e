//! Configuration: built-in defaults, then one TOML file, then `FLEETGATE_*` environment
//! variables (nested keys joined with `__`, e.g. `FLEETGATE_UPSTREAM__CONNECT_TIMEOUT_MS`).
//! Unknown keys anywhere are a start-up error that names them; `validate` checks the
//! cross-field rules after loading.
//!
//! - `schema.rs`: the settings and their defaults (`fleet.rs`: `[fleet]` and
//!   `[[models]]`; `jobs.rs`: `[jobs]`);
//! - `load.rs`: the layers merged into a [`Config`], figment's errors said by key;
//! - `validate.rs`: the rules beyond the types, one function per section.

mod fleet;
mod jobs;
mod load;
mod schema;
mod validate;

pub use fleet::{
    FleetSettings, Hold, ModelConfig, PREFIX_BLOCK_BYTES, QueueOrder, Routing, UpstreamConfig,
};
pub use jobs::JobSettings;
pub use load::ConfigError;
pub use schema::{
    AdminToken, Config, ConnectionSettings, LimitDefaults, LogFormat, RedisTlsSettings,
    RequestLogSettings, TlsSettings, TraceSettings, UpstreamSettings, WorkbenchSettings,
};
