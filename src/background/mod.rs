//! The work fleetgate does on its own, beside the requests: the health probes and
//! the keep-warm loop (`prober`), the job workers that claim and run completion jobs
//! (`job_workers`), the jobs' retention and cross-replica wake-ups (`job_upkeep`), the
//! Workbench's checkpoint sweeper (`checkpoint_sweeper`), the request log's retention
//! (`request_log_retention`) and the fair queue's service counts shared between
//! replicas (`service_exchange`). `server` starts each and stops it on shutdown.
//!
//! The write-behind writers of the usage ledger and the request log are started with
//! their handles (`ledger`, `request_log`), below the app state that holds them.

pub mod checkpoint_sweeper;
pub mod job_upkeep;
pub mod job_workers;
pub mod prober;
pub mod request_log_retention;
pub mod service_exchange;
