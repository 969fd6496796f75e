//! The completion core, `POST /v1/completions` without the HTTP: check → plan → admit
//! → dispatch → relay (`pipeline`), to an outcome (`outcome`) that the front door
//! renders and a job's run keeps.

pub mod admit;
pub mod budget_refusal;
pub mod cold;
pub mod cut;
pub mod dispatch;
pub mod meter;
pub mod outcome;
mod outgoing;
pub mod pipeline;
pub mod plan;
pub mod relay;
pub mod request;
pub mod settle;
pub mod watch;
