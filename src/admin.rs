//! The admin API under `/admin`, guarded by `admin_token` from the config (off, 404,
//! when none is set): create, list, show and revoke keys, set their limits, read their
//! usage.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use serde::{Deserialize, Deserializer, Serialize};
use subtle::ConstantTimeEq;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::admission::KeyLimits;
use crate::error::ApiError;
use crate::http::auth::bearer_token;
use crate::keys;
use crate::state::AppState;
use crate::store::{KeyRecord, LimitOverrides, LimitUpdate};
use crate::usage::{KeyUsage, key_usage};

pub fn admin_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_key, list_keys))
        .routes(routes!(show_key))
        .routes(routes!(revoke_key))
        .routes(routes!(set_limits))
        .routes(routes!(usage))
}

/// Lets a request through only with `Authorization: Bearer <admin_token>`.
pub async fn require_admin(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let Some(token) = &state.config().admin_token else {
        return Err(ApiError::NotFound {
            method: request.method().to_string(),
            path: request.uri().path().to_owned(),
        });
    };
    let presented = bearer_token(request.headers()).unwrap_or("");
    if !bool::from(presented.as_bytes().ct_eq(token.expose().as_bytes())) {
        return Err(ApiError::Unauthorized("This route needs the admin token."));
    }
    Ok(next.run(request).await)
}

/// A key as the admin API shows it (never its secret, which exists only at creation).
#[derive(Debug, Serialize, ToSchema)]
pub struct KeyView {
    id: i64,
    name: String,
    email: Option<String>,
    prefix: String,
    /// Unix seconds.
    created_at: i64,
    revoked_at: Option<i64>,
    active: bool,
    /// The limits in force (the key's own, else the configured defaults).
    limits: LimitsView,
    /// The key's own limits; null where the default applies.
    overrides: OverridesView,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LimitsView {
    monthly_budget: u64,
    requests_per_minute: u32,
    max_concurrent: u32,
    max_queued: u32,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OverridesView {
    monthly_budget: Option<u64>,
    requests_per_minute: Option<u32>,
    max_concurrent: Option<u32>,
    max_queued: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedKey {
    #[serde(flatten)]
    key: KeyView,
    /// The secret, shown only in this response.
    secret: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewKeyRequest {
    name: String,
    email: Option<String>,
    monthly_budget: Option<u64>,
    requests_per_minute: Option<u32>,
    max_concurrent: Option<u32>,
    max_queued: Option<u32>,
}

/// A change of limits: a field left out stays as it is, `null` returns it to the
/// default, a number sets it.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsPatch {
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u64>)]
    monthly_budget: Option<Option<u64>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>)]
    requests_per_minute: Option<Option<u32>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>)]
    max_concurrent: Option<Option<u32>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>)]
    max_queued: Option<Option<u32>>,
}

/// A field that is present (possibly `null`) becomes `Some`.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

impl KeyView {
    fn new(state: &AppState, record: &KeyRecord) -> Self {
        let limits = KeyLimits::resolve(&state.config().limits, &record.limits);
        Self {
            id: record.id,
            name: record.name.clone(),
            email: record.email.clone(),
            prefix: record.prefix.clone(),
            created_at: record.created_at,
            revoked_at: record.revoked_at,
            active: record.is_active(),
            limits: LimitsView {
                monthly_budget: limits.monthly_budget,
                requests_per_minute: limits.requests_per_minute,
                max_concurrent: limits.max_concurrent,
                max_queued: limits.max_queued,
            },
            overrides: OverridesView {
                monthly_budget: record.limits.monthly_budget,
                requests_per_minute: record.limits.requests_per_minute,
                max_concurrent: record.limits.max_concurrent,
                max_queued: record.limits.max_queued,
            },
        }
    }
}

fn body<T>(payload: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    payload
        .map(|Json(value)| value)
        .map_err(|rejection| ApiError::invalid(rejection.body_text()))
}

async fn find(state: &AppState, id_or_prefix: &str) -> Result<KeyRecord, ApiError> {
    state
        .store()
        .key(id_or_prefix)
        .await
        .map_err(ApiError::internal)?
        .ok_or_else(|| no_such_key(id_or_prefix))
}

fn no_such_key(id_or_prefix: &str) -> ApiError {
    ApiError::KeyNotFound(id_or_prefix.chars().take(64).collect())
}

fn check_limits(rpm: Option<Option<u32>>, concurrent: Option<Option<u32>>) -> Result<(), ApiError> {
    if rpm.flatten() == Some(0) || concurrent.flatten() == Some(0) {
        return Err(ApiError::invalid(
            "requests_per_minute and max_concurrent must be at least 1",
        ));
    }
    Ok(())
}

#[utoipa::path(post, path = "/admin/keys", tag = "admin", request_body = NewKeyRequest,
    responses((status = 201, body = CreatedKey), (status = 400, body = crate::openapi::ErrorEnvelopeDoc), (status = 401, body = crate::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn create_key(
    State(state): State<AppState>,
    payload: Result<Json<NewKeyRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<CreatedKey>), ApiError> {
    let new = body(payload)?;
    check_limits(Some(new.requests_per_minute), Some(new.max_concurrent))?;
    let limits = LimitOverrides {
        monthly_budget: new.monthly_budget,
        requests_per_minute: new.requests_per_minute,
        max_concurrent: new.max_concurrent,
        max_queued: new.max_queued,
    };
    let key = keys::generate();
    let record = state
        .store()
        .create_key(&new.name, new.email.as_deref(), &key, &limits)
        .await
        .map_err(ApiError::internal)?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedKey {
            key: KeyView::new(&state, &record),
            secret: key.secret.expose().to_owned(),
        }),
    ))
}

#[utoipa::path(get, path = "/admin/keys", tag = "admin",
    responses((status = 200, body = Vec<KeyView>), (status = 401, body = crate::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn list_keys(State(state): State<AppState>) -> Result<Json<Vec<KeyView>>, ApiError> {
    let records = state
        .store()
        .list_keys()
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(
        records.iter().map(|r| KeyView::new(&state, r)).collect(),
    ))
}

#[utoipa::path(get, path = "/admin/keys/{key}", tag = "admin",
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = KeyView), (status = 404, body = crate::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn show_key(
    State(state): State<AppState>,
    Path(key): Path<String>,
) -> Result<Json<KeyView>, ApiError> {
    let record = find(&state, &key).await?;
    Ok(Json(KeyView::new(&state, &record)))
}

#[utoipa::path(post, path = "/admin/keys/{key}/revoke", tag = "admin",
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = KeyView), (status = 404, body = crate::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn revoke_key(
    State(state): State<AppState>,
    Path(key): Path<String>,
) -> Result<Json<KeyView>, ApiError> {
    let record = state
        .store()
        .revoke_key(&key)
        .await
        .map_err(ApiError::internal)?
        .ok_or_else(|| no_such_key(&key))?;
    Ok(Json(KeyView::new(&state, &record)))
}

#[utoipa::path(patch, path = "/admin/keys/{key}/limits", tag = "admin", request_body = LimitsPatch,
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = KeyView), (status = 400, body = crate::openapi::ErrorEnvelopeDoc), (status = 404, body = crate::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn set_limits(
    State(state): State<AppState>,
    Path(key): Path<String>,
    payload: Result<Json<LimitsPatch>, JsonRejection>,
) -> Result<Json<KeyView>, ApiError> {
    let patch = body(payload)?;
    check_limits(patch.requests_per_minute, patch.max_concurrent)?;
    let update = LimitUpdate {
        monthly_budget: patch.monthly_budget,
        requests_per_minute: patch.requests_per_minute,
        max_concurrent: patch.max_concurrent,
        max_queued: patch.max_queued,
    };
    let record = state
        .store()
        .set_limits(&key, &update)
        .await
        .map_err(ApiError::internal)?
        .ok_or_else(|| no_such_key(&key))?;
    Ok(Json(KeyView::new(&state, &record)))
}

#[utoipa::path(get, path = "/admin/keys/{key}/usage", tag = "admin",
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = KeyUsage), (status = 404, body = crate::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn usage(
    State(state): State<AppState>,
    Path(key): Path<String>,
) -> Result<Json<KeyUsage>, ApiError> {
    let record = find(&state, &key).await?;
    let limits = KeyLimits::resolve(&state.config().limits, &record.limits);
    key_usage(&state, record.id, &record.prefix, &limits)
        .await
        .map(Json)
}
