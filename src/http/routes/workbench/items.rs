//! `/v1/workbench/items`: the Workbench's saved prompts and runs, and the recovery
//! checkpoints of runs not yet saved (`checkpoint: true`), which expire after
//! `workbench.checkpoint_ttl_secs` (seven days) unless saved first.

use axum::Extension;
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::answer::{
    JsonObject, checked_title, deleted, json_text, max_bytes, not_found, store, store_error,
    stored_json, versioned,
};
use super::page::{ListPage, PageParams};
use crate::error::ApiError;
use crate::http::auth::Caller;
use crate::http::body::JsonBody;
use crate::state::AppState;
use crate::store::now_unix;
use crate::store::workbench::{Cursor, ItemChange, ItemRecord, ItemSummary, NewItem};

/// What an item holds.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ItemKind {
    /// A prompt with its settings.
    Prompt,
    /// A prompt, its settings and the completion it got.
    Run,
}

impl ItemKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Prompt => "prompt",
            Self::Run => "run",
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewItemRequest {
    kind: ItemKind,
    /// At most 200 characters.
    #[serde(default)]
    title: String,
    /// A JSON object: the page keeps the prompt, the settings and the completion here.
    #[schema(value_type = Object)]
    content: JsonObject,
    /// `true`: a recovery checkpoint, deleted after `workbench.checkpoint_ttl_secs`
    /// (seven days) unless saved; `false` (default): saved until deleted.
    #[serde(default)]
    checkpoint: bool,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ItemPatch {
    /// The version the change was made from; another one is 409 `version_conflict`.
    version: i64,
    title: Option<String>,
    #[schema(value_type = Option<Object>)]
    content: Option<JsonObject>,
    /// `true` saves a checkpoint: it no longer expires. (`false` changes nothing: a
    /// saved item is never turned back into a checkpoint.)
    #[serde(default)]
    saved: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ItemView {
    id: i64,
    kind: String,
    title: String,
    #[schema(value_type = Object)]
    content: serde_json::Value,
    /// Grows by one with every change.
    version: i64,
    /// Unix seconds.
    created_at: i64,
    updated_at: i64,
    /// Unix seconds when this checkpoint expires; `null` once saved.
    expires_at: Option<i64>,
}

impl From<ItemRecord> for ItemView {
    fn from(item: ItemRecord) -> Self {
        Self {
            id: item.id,
            content: stored_json(&item.content),
            kind: item.kind,
            title: item.title,
            version: item.version,
            created_at: item.created_at,
            updated_at: item.updated_at,
            expires_at: item.expires_at,
        }
    }
}

/// An item in a list: everything but its content (`GET /v1/workbench/items/{id}`).
#[derive(Debug, Serialize, ToSchema)]
pub struct ItemEntry {
    id: i64,
    kind: String,
    title: String,
    version: i64,
    created_at: i64,
    updated_at: i64,
    /// Unix seconds when this checkpoint expires; `null` once saved.
    expires_at: Option<i64>,
}

impl From<ItemSummary> for ItemEntry {
    fn from(item: ItemSummary) -> Self {
        Self {
            id: item.id,
            kind: item.kind,
            title: item.title,
            version: item.version,
            created_at: item.created_at,
            updated_at: item.updated_at,
            expires_at: item.expires_at,
        }
    }
}

#[utoipa::path(get, path = "/v1/workbench/items", tag = "workbench",
    params(PageParams),
    responses(
        (status = 200, description = "A page of the key's saved items and unexpired checkpoints, most recently changed first, without their content (fetch an item for it).", body = ListPage<ItemEntry>),
        (status = 400, description = "`invalid_request`: `limit` outside 1–100, a `cursor` that is not a `next_cursor`, an unknown parameter.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn list_items(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(params): Query<PageParams>,
) -> Result<Json<ListPage<ItemEntry>>, ApiError> {
    let paging = params.paging()?;
    let items = store(&state)
        .items(caller.0.id, now_unix(), &paging.query)
        .await
        .map_err(store_error)?;
    let place = |item: &ItemSummary| Cursor {
        updated_at: item.updated_at,
        id: item.id,
    };
    Ok(Json(paging.answer(items, place, ItemEntry::from)))
}

#[utoipa::path(post, path = "/v1/workbench/items", tag = "workbench", request_body = NewItemRequest,
    responses(
        (status = 201, description = "The new item.", body = ItemView),
        (status = 400, description = "`invalid_request`: bad JSON, an unknown field, a title over 200 characters.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less); `storage_quota_exceeded`: the key would keep more than `workbench.max_bytes_per_key`, and nothing was written. Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn create_item(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    JsonBody(request): JsonBody<NewItemRequest>,
) -> Result<(StatusCode, Json<ItemView>), ApiError> {
    let now = now_unix();
    let ttl = i64::try_from(state.config().workbench.checkpoint_ttl_secs).unwrap_or(i64::MAX);
    let content = json_text(&request.content);
    let item = NewItem {
        kind: request.kind.as_str(),
        title: checked_title(&request.title)?,
        content: &content,
        expires_at: request.checkpoint.then(|| now.saturating_add(ttl)),
    };
    let created = store(&state)
        .create_item(caller.0.id, &item, max_bytes(&state), now)
        .await
        .map_err(store_error)?;
    Ok((StatusCode::CREATED, Json(created.into())))
}

#[utoipa::path(get, path = "/v1/workbench/items/{id}", tag = "workbench",
    params(("id" = i64, Path, description = "The item's id")),
    responses(
        (status = 200, description = "The item.", body = ItemView),
        (status = 400, description = "`invalid_request`: the id is not a 64-bit integer.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`: no such item for this key (another key's items are never shown), or an expired checkpoint.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn get_item(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<i64>,
) -> Result<Json<ItemView>, ApiError> {
    let item = store(&state)
        .item(caller.0.id, id, now_unix())
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found("item", id))?;
    Ok(Json(item.into()))
}

#[utoipa::path(patch, path = "/v1/workbench/items/{id}", tag = "workbench", request_body = ItemPatch,
    params(("id" = i64, Path, description = "The item's id")),
    responses(
        (status = 200, description = "The changed item, at its next version.", body = ItemView),
        (status = 400, description = "`invalid_request`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less). Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 409, description = "`version_conflict`: the item was changed since `version` (in another tab); nothing was changed.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 413, description = "`storage_quota_exceeded`: a new title or content would leave the key keeping more than `workbench.max_bytes_per_key`; nothing was changed. `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn update_item(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<i64>,
    JsonBody(patch): JsonBody<ItemPatch>,
) -> Result<Json<ItemView>, ApiError> {
    let content = patch.content.as_ref().map(json_text);
    let change = ItemChange {
        version: patch.version,
        title: patch.title.as_deref().map(checked_title).transpose()?,
        content: content.as_deref(),
        save: patch.saved,
    };
    let outcome = store(&state)
        .update_item(caller.0.id, id, &change, max_bytes(&state), now_unix())
        .await
        .map_err(store_error)?;
    versioned(outcome, "item", id, patch.version).map(|item| Json(item.into()))
}

#[utoipa::path(delete, path = "/v1/workbench/items/{id}", tag = "workbench",
    params(("id" = i64, Path, description = "The item's id")),
    responses(
        (status = 204, description = "Deleted."),
        (status = 400, description = "`invalid_request`: the id is not a 64-bit integer.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 429, description = "`rate_limited`: more requests per minute than the key's rate, which Workbench requests and completions count against alike.", body = crate::http::openapi::ErrorEnvelopeDoc,
            headers(("Retry-After" = u32, description = "Seconds to wait."))),
        (status = 404, description = "`not_found`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = [])))]
pub async fn delete_item(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<i64>,
) -> Result<StatusCode, ApiError> {
    let done = store(&state)
        .delete_item(caller.0.id, id, now_unix())
        .await
        .map_err(store_error)?;
    deleted(done, "item", id)
}
