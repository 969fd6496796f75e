//! POST /v1/completions: parse, plan, forward.

pub mod request;
