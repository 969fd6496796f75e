//! The Workbench and Loom: two pages fleetgate serves itself (`GET /workbench`,
//! `GET /loom`, every asset embedded in the binary) and the key-protected API behind
//! them under `/v1/workbench/…`, which keeps each key's saved prompts, runs and Loom
//! trees in the store (`store::workbench`), up to `workbench.max_bytes_per_key` a key;
//! its lists come a page at a time (`page`) and carry no content.
//!
//! Every `/v1/workbench` request counts against the key's rate as a completion does
//! (`rate`).
//!
//! The pages run completions through the public `POST /v1/completions` with
//! `X-Acs-Budget-Clamp: refuse` (see `completion::budget_refusal`), so a run that the
//! key's budget would clamp is refused instead.

mod answer;
pub mod items;
pub mod page;
pub mod pages;
pub mod rate;
pub mod trees;

use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::state::AppState;

/// The key-protected `/v1/workbench` routes.
pub fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(items::list_items, items::create_item))
        .routes(routes!(
            items::get_item,
            items::update_item,
            items::delete_item
        ))
        .routes(routes!(trees::list_trees, trees::create_tree))
        .routes(routes!(trees::import_tree))
        .routes(routes!(
            trees::get_tree,
            trees::rename_tree,
            trees::delete_tree
        ))
        .routes(routes!(trees::export_tree))
        .routes(routes!(trees::add_node))
        .routes(routes!(trees::set_node_flags))
}
