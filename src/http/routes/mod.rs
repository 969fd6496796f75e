//! The route handlers: what each documented path answers. The router
//! (`http::router`) puts them under the layers every request passes.

pub mod admin;
pub mod completions;
pub mod harvest;
pub mod job_view;
pub mod models;
pub mod ops;
pub mod usage;
pub mod workbench;
