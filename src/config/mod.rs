//! Configuration: built-in defaults, then one TOML file, then `FLEETGATE_*` environment
//! variables (nested keys joined with `__`, e.g. `FLEETGATE_UPSTREAM__CONNECT_TIMEOUT_MS`).
//! Unknown keys anywhere are a start-up error that names them; `validate` checks the
//! cross-field rules after loading. Every problem is said at once, each with the line or
//! variable that set its key (what `fleetgate config check` prints).
//!
//! - `schema.rs`: the settings and their defaults (`fleet.rs`: `[fleet]` and
//!   `[[models]]`; `jobs.rs`: `[jobs]`);
//! - `load.rs`: the layers merged into a [`Config`], every problem said;
//! - `extract.rs`: serde's reading, going on past each problem to find the next;
//! - `locate.rs`: where a key was set (the file's line, or the variable);
//! - `validate.rs`: the rules beyond the types, one function per section.

mod extract;
mod fleet;
mod jobs;
mod load;
mod locate;
mod schema;
mod validate;

pub use fleet::{
    FleetSettings, Hold, ModelConfig, PREFIX_BLOCK_BYTES, QueueOrder, Routing, UpstreamConfig,
};
pub use jobs::JobSettings;
pub use load::{ConfigError, Problem};
pub use locate::Origin;
pub use schema::{
    AdminToken, Config, ConnectionSettings, LimitDefaults, LogFormat, RedisTlsSettings,
    RequestLogSettings, TlsSettings, TraceSettings, UpstreamSettings, WorkbenchSettings,
};
