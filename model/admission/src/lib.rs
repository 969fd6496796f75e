//! A model of fleetgate's shared admission protocol — budgets, rates, slots and queue
//! places held in Redis by several gateway replicas, the usage journal, the write-behind
//! ledger and the seeding of counters from it — and the properties it must keep, checked
//! over every interleaving up to a bound with [stateright].
//!
//! - [`scripts`]: what each Lua script does to the data in Redis, as plain Rust; held to
//!   the real scripts by `tests/conformance.rs` (a real Redis, random traces, the data
//!   compared after every call);
//! - [`system`]: the replicas, their requests, Redis, the store and the faults, as a
//!   stateright model;
//! - [`properties`]: what must hold in every state, and after the faults stop.
//!
//! `cargo run --release -p admission-model -- --help` checks larger bounds than the
//! tests do and prints the figures quoted in `docs/reliability.md`.

pub mod properties;
pub mod scripts;
pub mod system;
