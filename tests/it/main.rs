//! The in-process integration tests, one module per suite, in one test binary (each test
//! binary links the whole dependency tree, so one is much faster to build than many):
//! fleetgate on an ephemeral port in front of in-process mock-vllm nodes, its router
//! without a socket, and the store and limiter suites. The suites that run the real
//! binaries as child processes are targets of their own (`tests/binary.rs`,
//! `tests/replicas.rs`); all three share the harness in `tests/common`.
//!
//! Every test here runs in one process, in parallel with the others: nothing may set
//! environment variables, change the working directory, install a global subscriber or
//! use a fixed file name or port.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

#[path = "../common/mod.rs"]
mod common;

// First: its `backend_tests!` is used by the suites declared after it.
#[macro_use]
mod store;

mod abuse_aborts;
mod abuse_admission;
mod abuse_connections;
mod abuse_nodes;
mod abuse_storage;
mod admin;
mod admission;
mod cold_boot;
mod connections;
mod deadline;
mod fair_share;
mod faults;
mod fleet;
mod gateway;
mod health;
mod hold;
mod job_store;
mod jobs;
mod keys;
mod ledger;
mod limiter;
mod metadata_log;
mod metrics;
mod openapi;
mod prefix;
mod reload;
mod rotation;
mod router;
mod store_tls;
mod workbench;
