//! Completion jobs: submit now (`POST /v1/completions` with `Prefer: respond-async`),
//! harvest later (`GET /v1/harvest/{id}?wait=`). Jobs live in the store (`jobs` table),
//! so they survive a restart and any replica's workers can run them; a claim is a
//! leased, fenced attempt, so no job runs twice at once and a dead replica's jobs are
//! taken over when their lease lapses.
//!
//! - `submit`: the submission, checked and admitted like a synchronous call;
//! - `harvest`: the key's own jobs: get (long-poll), list, cancel;
//! - `worker` / `run`: claiming and running;
//! - `upkeep`: retention, job counts, waking long-polls across replicas;
//! - `view`: the job object.
//!
//! What this replica's handlers and workers share (long-polls, the runs here) is
//! `crate::job_hub`'s, held by the app state.

pub mod run;
pub mod submit;
