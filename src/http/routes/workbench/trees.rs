//! `/v1/workbench/trees`: Loom's trees of continuations. Nodes are only ever added
//! (an edited text is a new sibling), so two tabs growing one tree never lose a node;
//! a node's flags (bookmarked, pruned) and a tree's title change with optimistic
//! versions. A tree exports to JSON and imports back as a new tree: at most
//! `workbench.max_import_nodes` nodes, written in batches (see
//! `WorkbenchStore::create_tree`).

use std::collections::HashMap;

use axum::Extension;
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::answer::{
    JsonObject, checked_title, deleted, json_text, max_bytes, not_found, store, store_error,
    stored_json, stored_object, versioned,
};
use super::page::{ListPage, PageParams};
use crate::error::ApiError;
use crate::http::auth::Caller;
use crate::http::body::JsonBody;
use crate::state::AppState;
use crate::store::now_unix;
use crate::store::workbench::{
    Added, Cursor, NewNode, NodeFlags, NodeRecord, ROW_BYTES, TreeNode, TreeRecord,
};

/// The `format` of an exported tree.
const EXPORT_FORMAT: &str = "fleetgate-loom/1";

#[derive(Debug, Serialize, ToSchema)]
pub struct TreeSummary {
    id: i64,
    title: String,
    /// Grows by one with every change of the title.
    version: i64,
    /// Unix seconds.
    created_at: i64,
    /// Unix seconds of the last change to the tree or one of its nodes.
    updated_at: i64,
}

impl From<TreeRecord> for TreeSummary {
    fn from(tree: TreeRecord) -> Self {
        Self {
            id: tree.id,
            title: tree.title,
            version: tree.version,
            created_at: tree.created_at,
            updated_at: tree.updated_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct NodeView {
    id: i64,
    /// `null` for the root.
    parent_id: Option<i64>,
    text: String,
    /// What the page stored with the node (the run's settings, per-token logprobs).
    #[schema(value_type = Object)]
    meta: serde_json::Value,
    bookmarked: bool,
    /// Hidden with its subtree in the page; unpruning brings it back.
    pruned: bool,
    /// Grows by one with every change of the flags.
    version: i64,
    created_at: i64,
}

impl From<NodeRecord> for NodeView {
    fn from(node: NodeRecord) -> Self {
        Self {
            id: node.id,
            parent_id: node.parent_id,
            meta: stored_json(&node.meta),
            text: node.text,
            bookmarked: node.bookmarked,
            pruned: node.pruned,
            version: node.version,
            created_at: node.created_at,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TreeView {
    tree: TreeSummary,
    /// Every node, pruned ones too, oldest first (a parent before its children).
    nodes: Vec<NodeView>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTreeRequest {
    /// At most 200 characters.
    #[serde(default)]
    title: String,
    /// The root's text: the document's beginning.
    root_text: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TreePatch {
    /// The version the change was made from; another one is 409 `version_conflict`.
    version: i64,
    title: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewNodeRequest {
    /// A node of this tree.
    parent_id: i64,
    text: String,
    #[serde(default)]
    #[schema(value_type = Object)]
    meta: JsonObject,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NodePatch {
    /// The version the change was made from; another one is 409 `version_conflict`.
    version: i64,
    bookmarked: Option<bool>,
    pruned: Option<bool>,
}

/// A tree as exported, and as imported.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TreeExport {
    /// `fleetgate-loom/1`.
    format: String,
    title: String,
    /// The root first; each node's `parent_id` names an earlier node's `id`.
    nodes: Vec<ExportNode>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExportNode {
    /// Unique within the export (an import gives new ids).
    id: i64,
    parent_id: Option<i64>,
    text: String,
    #[serde(default)]
    #[schema(value_type = Object)]
    meta: JsonObject,
    #[serde(default)]
    bookmarked: bool,
    #[serde(default)]
    pruned: bool,
}

#[utoipa::path(get, path = "/v1/workbench/trees", tag = "workbench",
    params(PageParams),
    responses(
        (status = 200, description = "A page of the key's trees, most recently changed first, without their nodes (fetch a tree for them).", body = ListPage<TreeSummary>),
        (status = 400, description = "`invalid_request`: `limit` outside 1–100, a `cursor` that is not a `next_cursor`, an unknown parameter.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn list_trees(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(params): Query<PageParams>,
) -> Result<Json<ListPage<TreeSummary>>, ApiError> {
    let paging = params.paging()?;
    let trees = store(&state)
        .trees(caller.0.id, &paging.query)
        .await
        .map_err(store_error)?;
    let place = |tree: &TreeRecord| Cursor {
        updated_at: tree.updated_at,
        id: tree.id,
    };
    Ok(Json(paging.answer(trees, place, TreeSummary::from)))
}

/// The tree and its nodes as the API shows them.
fn view(tree: TreeRecord, nodes: Vec<NodeRecord>) -> TreeView {
    TreeView {
        tree: tree.into(),
        nodes: nodes.into_iter().map(NodeView::from).collect(),
    }
}

#[utoipa::path(post, path = "/v1/workbench/trees", tag = "workbench", request_body = NewTreeRequest,
    responses(
        (status = 201, description = "The new tree with its root.", body = TreeView),
        (status = 400, description = "`invalid_request`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less); `storage_quota_exceeded`: the key would keep more than `workbench.max_bytes_per_key`, and nothing was written. Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn create_tree(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    JsonBody(request): JsonBody<NewTreeRequest>,
) -> Result<(StatusCode, Json<TreeView>), ApiError> {
    let root = TreeNode {
        parent: None,
        text: &request.root_text,
        meta: "{}",
        bookmarked: false,
        pruned: false,
    };
    let (tree, nodes) = store(&state)
        .create_tree(
            caller.0.id,
            checked_title(&request.title)?,
            &[root],
            max_bytes(&state),
            now_unix(),
        )
        .await
        .map_err(store_error)?;
    Ok((StatusCode::CREATED, Json(view(tree, nodes))))
}

#[utoipa::path(post, path = "/v1/workbench/trees/import", tag = "workbench", request_body = TreeExport,
    responses(
        (status = 201, description = "The imported tree, a new one with new ids. Written in batches: until the import is answered, the tree shows part of its nodes; if it fails, it is deleted again.", body = TreeView),
        (status = 400, description = "`invalid_request`: not an export (`format` other than `fleetgate-loom/1`, an unknown field), no root, a node whose parent is not an earlier node.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less), or has more than `workbench.max_import_nodes` nodes; `storage_quota_exceeded`: the key would keep more than `workbench.max_bytes_per_key`. Nothing was written either way. Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn import_tree(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    JsonBody(export): JsonBody<TreeExport>,
) -> Result<(StatusCode, Json<TreeView>), ApiError> {
    if export.format != EXPORT_FORMAT {
        return Err(ApiError::invalid_param(
            "format",
            format!("format must be '{EXPORT_FORMAT}' (got '{}')", export.format),
        ));
    }
    let most = state.config().workbench.max_import_nodes;
    if export.nodes.len() > most as usize {
        return Err(ApiError::ImportTooLarge {
            nodes: export.nodes.len(),
            limit: most,
        });
    }
    let metas: Vec<String> = export.nodes.iter().map(|n| json_text(&n.meta)).collect();
    let mut positions = HashMap::with_capacity(export.nodes.len());
    let mut nodes = Vec::with_capacity(export.nodes.len());
    for (index, node) in export.nodes.iter().enumerate() {
        let parent = match node.parent_id {
            None => None,
            Some(parent_id) => Some(*positions.get(&parent_id).ok_or_else(|| {
                ApiError::invalid_param(
                    "nodes",
                    format!(
                        "node {} names parent {parent_id}, which is not an earlier node",
                        node.id
                    ),
                )
            })?),
        };
        if positions.insert(node.id, index).is_some() {
            return Err(ApiError::invalid_param(
                "nodes",
                format!("node id {} appears twice", node.id),
            ));
        }
        nodes.push(TreeNode {
            parent,
            text: &node.text,
            meta: &metas[index],
            bookmarked: node.bookmarked,
            pruned: node.pruned,
        });
    }
    let title = checked_title(&export.title)?;
    // Refused before the first batch when it cannot fit (each batch checks again, for
    // the key's writes meanwhile).
    let limit = max_bytes(&state);
    let stored = store(&state)
        .stored_bytes(caller.0.id)
        .await
        .map_err(store_error)?;
    let tree_bytes = ROW_BYTES.saturating_add(len(title));
    let bytes = nodes
        .iter()
        .fold(stored.saturating_add(tree_bytes), |sum, node| {
            sum.saturating_add(ROW_BYTES + len(node.text) + len(node.meta))
        });
    if bytes > limit {
        return Err(ApiError::StorageQuotaExceeded { bytes, limit });
    }
    let (tree, nodes) = store(&state)
        .create_tree(caller.0.id, title, &nodes, limit, now_unix())
        .await
        .map_err(store_error)?;
    Ok((StatusCode::CREATED, Json(view(tree, nodes))))
}

/// The bytes of a text, as the store counts them.
fn len(text: &str) -> i64 {
    i64::try_from(text.len()).unwrap_or(i64::MAX)
}

#[utoipa::path(get, path = "/v1/workbench/trees/{id}", tag = "workbench",
    params(("id" = i64, Path, description = "The tree's id")),
    responses(
        (status = 200, description = "The tree and all its nodes.", body = TreeView),
        (status = 400, description = "`invalid_request`: the id is not a 64-bit integer.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`: no such tree for this key (another key's trees are never shown).", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn get_tree(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<i64>,
) -> Result<Json<TreeView>, ApiError> {
    let (tree, nodes) = store(&state)
        .tree(caller.0.id, id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found("tree", id))?;
    Ok(Json(view(tree, nodes)))
}

#[utoipa::path(get, path = "/v1/workbench/trees/{id}/export", tag = "workbench",
    params(("id" = i64, Path, description = "The tree's id")),
    responses(
        (status = 200, description = "The tree as JSON that `POST /v1/workbench/trees/import` takes back.", body = TreeExport),
        (status = 400, description = "`invalid_request`: the id is not a 64-bit integer.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn export_tree(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<i64>,
) -> Result<Json<TreeExport>, ApiError> {
    let (tree, nodes) = store(&state)
        .tree(caller.0.id, id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found("tree", id))?;
    Ok(Json(TreeExport {
        format: EXPORT_FORMAT.to_owned(),
        title: tree.title,
        nodes: nodes
            .into_iter()
            .map(|node| ExportNode {
                id: node.id,
                parent_id: node.parent_id,
                meta: stored_object(&node.meta),
                text: node.text,
                bookmarked: node.bookmarked,
                pruned: node.pruned,
            })
            .collect(),
    }))
}

#[utoipa::path(patch, path = "/v1/workbench/trees/{id}", tag = "workbench", request_body = TreePatch,
    params(("id" = i64, Path, description = "The tree's id")),
    responses(
        (status = 200, description = "The renamed tree.", body = TreeSummary),
        (status = 400, description = "`invalid_request`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less). Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 409, description = "`version_conflict`: renamed since `version`; nothing was changed.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn rename_tree(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<i64>,
    JsonBody(patch): JsonBody<TreePatch>,
) -> Result<Json<TreeSummary>, ApiError> {
    let outcome = store(&state)
        .rename_tree(
            caller.0.id,
            id,
            patch.version,
            checked_title(&patch.title)?,
            now_unix(),
        )
        .await
        .map_err(store_error)?;
    versioned(outcome, "tree", id, patch.version).map(|tree| Json(tree.into()))
}

#[utoipa::path(delete, path = "/v1/workbench/trees/{id}", tag = "workbench",
    params(("id" = i64, Path, description = "The tree's id")),
    responses(
        (status = 204, description = "The tree and all its nodes are deleted."),
        (status = 400, description = "`invalid_request`: the id is not a 64-bit integer.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn delete_tree(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<i64>,
) -> Result<StatusCode, ApiError> {
    let done = store(&state)
        .delete_tree(caller.0.id, id)
        .await
        .map_err(store_error)?;
    deleted(done, "tree", id)
}

#[utoipa::path(post, path = "/v1/workbench/trees/{id}/nodes", tag = "workbench", request_body = NewNodeRequest,
    params(("id" = i64, Path, description = "The tree's id")),
    responses(
        (status = 201, description = "The new node.", body = NodeView),
        (status = 400, description = "`invalid_request`: bad JSON, or `parent_id` is not a node of this tree.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`: no such tree for this key.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less); `storage_quota_exceeded`: the key would keep more than `workbench.max_bytes_per_key`, and nothing was written. Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn add_node(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<i64>,
    JsonBody(request): JsonBody<NewNodeRequest>,
) -> Result<(StatusCode, Json<NodeView>), ApiError> {
    let meta = json_text(&request.meta);
    let added = store(&state)
        .add_node(
            caller.0.id,
            id,
            &NewNode {
                parent_id: request.parent_id,
                text: &request.text,
                meta: &meta,
            },
            max_bytes(&state),
            now_unix(),
        )
        .await
        .map_err(store_error)?;
    match added {
        Added::Node(node) => Ok((StatusCode::CREATED, Json(node.into()))),
        Added::NoTree => Err(not_found("tree", id)),
        Added::NoParent => Err(ApiError::invalid_param(
            "parent_id",
            format!("parent_id {} is not a node of tree {id}", request.parent_id),
        )),
    }
}

#[utoipa::path(patch, path = "/v1/workbench/trees/{id}/nodes/{node_id}", tag = "workbench", request_body = NodePatch,
    params(
        ("id" = i64, Path, description = "The tree's id"),
        ("node_id" = i64, Path, description = "The node's id"),
    ),
    responses(
        (status = 200, description = "The node with its new flags.", body = NodeView),
        (status = 400, description = "`invalid_request`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`: no such tree for this key, or no such node in it.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less). Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 409, description = "`version_conflict`: the node's flags changed since `version`; nothing was changed.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn set_node_flags(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((id, node_id)): Path<(i64, i64)>,
    JsonBody(patch): JsonBody<NodePatch>,
) -> Result<Json<NodeView>, ApiError> {
    let flags = NodeFlags {
        version: patch.version,
        bookmarked: patch.bookmarked,
        pruned: patch.pruned,
    };
    let outcome = store(&state)
        .set_node_flags(caller.0.id, id, node_id, &flags, now_unix())
        .await
        .map_err(store_error)?;
    versioned(outcome, "node", node_id, patch.version).map(|node| Json(node.into()))
}
