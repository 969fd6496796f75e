//! The admin API under `/admin`, guarded by `admin_token` from the config (off, 404,
//! when none is set): create, list, show, rotate and revoke keys, set their limits and
//! expiry, read their usage; reload the config file (`POST /admin/reload`). The work, and the check of the
//! limit values, is the key service's ([`crate::keys::KeyService`]) and the reload's
//! ([`crate::reload`]); the handlers only read the bodies and render the answers.

use axum::Json;
use axum::extract::{FromRequest as _, Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use serde::{Deserialize, Deserializer, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::ApiError;
use crate::http::auth::{bearer_token, is_admin_token};
use crate::http::body::JsonBody;
use crate::http::routes::usage::{KeyUsage, key_usage};
use crate::key_limits::LimitInput;
use crate::keys::{
    DEFAULT_GRACE_SECS, KeyError, KeyService, LimitsChange, MAX_GRACE_SECS, NewLimits,
};
use crate::reload::Reloaded;
use crate::request_record::RequestRecord;
use crate::state::AppState;
use crate::store::{KeyRecord, StoreError, now_unix};
use crate::times::parse_time;

pub fn admin_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_key, list_keys))
        .routes(routes!(show_key))
        .routes(routes!(revoke_key))
        .routes(routes!(rotate_key))
        .routes(routes!(set_limits))
        .routes(routes!(usage))
        .routes(routes!(reload))
}

/// Lets a request through only with `Authorization: Bearer <admin_token>`.
pub async fn require_admin(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if state.config().admin_token.is_none() {
        return Err(ApiError::NotFound {
            method: request.method().to_string(),
            path: request.uri().path().to_owned(),
        });
    }
    let presented = bearer_token(request.headers()).unwrap_or("");
    if !is_admin_token(&state, presented) {
        return Err(ApiError::Unauthorized("This route needs the admin token."));
    }
    if let Some(record) = request.extensions().get::<RequestRecord>() {
        record.set_authenticated();
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
    /// Unix seconds from which the key is refused; null: never.
    expires_at: Option<i64>,
    /// While a rotation's grace lasts, Unix seconds from which the secret it replaced
    /// is refused; null when no previous secret works.
    previous_secret_expires_at: Option<i64>,
    /// Whether requests may use the key now: neither revoked nor expired.
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
    /// The key's weight in its models' fleet queues.
    share: u32,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OverridesView {
    monthly_budget: Option<u64>,
    requests_per_minute: Option<u32>,
    max_concurrent: Option<u32>,
    max_queued: Option<u32>,
    share: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedKey {
    #[serde(flatten)]
    key: KeyView,
    /// The secret, shown only in this response.
    secret: String,
}

// The limit fields' documented bounds are the key service's (`key_limits::Limit`); a unit test
// below holds them to it.

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewKeyRequest {
    name: String,
    email: Option<String>,
    #[schema(value_type = Option<u64>, minimum = 0, maximum = 9223372036854775807_i64)]
    monthly_budget: Option<JsonLimit>,
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 2147483647)]
    requests_per_minute: Option<JsonLimit>,
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 2147483647)]
    max_concurrent: Option<JsonLimit>,
    #[schema(value_type = Option<u32>, minimum = 0, maximum = 2147483647)]
    max_queued: Option<JsonLimit>,
    /// The key's weight in its models' fleet queues: while a model's nodes are all busy,
    /// keys with work waiting get node slots in proportion to their share, counted in
    /// tokens.
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    share: Option<JsonLimit>,
    /// When the key stops working: an RFC 3339 time (`2027-01-01T00:00:00Z`) or Unix
    /// seconds, up to 9999-12-31T23:59:59Z; a time already past makes a key refused from
    /// the start. Left out or null: never.
    #[schema(value_type = Option<String>, format = DateTime)]
    expires_at: Option<JsonExpiry>,
}

/// How a key's secret is rotated.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateRequest {
    /// How long the secret being replaced keeps working, in seconds (default 86400, a
    /// day; at most 2592000, 30 days); 0 stops it at once. A rotation during another's
    /// grace keeps only the secret it replaces: the one before stops at once.
    #[schema(value_type = Option<u64>, minimum = 0, maximum = 2592000)]
    grace_seconds: Option<JsonLimit>,
}

impl RotateRequest {
    /// The grace asked for (the default when none is), or the refusal of a value that is
    /// no whole number of seconds, naming the field. The bound is the key service's to
    /// check.
    fn grace_secs(&self) -> Result<u64, ApiError> {
        let Some(JsonLimit(input)) = &self.grace_seconds else {
            return Ok(DEFAULT_GRACE_SECS);
        };
        let text = match input {
            LimitInput::Whole(n) => match u64::try_from(*n) {
                Ok(secs) => return Ok(secs),
                Err(_) => n.to_string(),
            },
            LimitInput::Other(text) => text.chars().take(64).collect(),
        };
        Err(ApiError::invalid_param(
            "grace_seconds",
            format!(
                "grace_seconds must be a whole number of seconds from 0 to {MAX_GRACE_SECS} (got {text})"
            ),
        ))
    }
}

/// A change of limits and expiry: a field left out stays as it is, `null` returns a
/// limit to the default (and clears the expiry), a value sets it.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsPatch {
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u64>, minimum = 0, maximum = 9223372036854775807_i64)]
    monthly_budget: Option<Option<JsonLimit>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 2147483647)]
    requests_per_minute: Option<Option<JsonLimit>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 2147483647)]
    max_concurrent: Option<Option<JsonLimit>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, minimum = 0, maximum = 2147483647)]
    max_queued: Option<Option<JsonLimit>>,
    /// The key's weight in its models' fleet queues: while a model's nodes are all busy,
    /// keys with work waiting get node slots in proportion to their share, counted in
    /// tokens.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    share: Option<Option<JsonLimit>>,
    /// When the key stops working: an RFC 3339 time (`2027-01-01T00:00:00Z`) or Unix
    /// seconds, up to 9999-12-31T23:59:59Z (a time already past refuses the key from now
    /// on); null: never.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>, format = DateTime)]
    expires_at: Option<Option<JsonExpiry>>,
}

/// An expiry field of a body (not `null`): any JSON value, read by [`JsonExpiry::at`]
/// so that a bad one is refused naming the field.
#[derive(Debug)]
struct JsonExpiry(serde_json::Value);

impl<'de> Deserialize<'de> for JsonExpiry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde_json::Value::deserialize(d).map(Self)
    }
}

impl JsonExpiry {
    /// The Unix seconds of an RFC 3339 time or a whole number of Unix seconds.
    fn at(&self) -> Result<i64, ApiError> {
        let at = match &self.0 {
            serde_json::Value::Number(n) => n.as_i64(),
            serde_json::Value::String(text) => parse_time(text),
            _ => None,
        };
        at.ok_or_else(|| {
            ApiError::invalid_param(
                "expires_at",
                format!(
                    "expires_at must be an RFC 3339 time such as 2027-01-01T00:00:00Z, or Unix seconds (got {})",
                    self.0.to_string().chars().take(64).collect::<String>()
                ),
            )
        })
    }
}

/// A limit field of a body (not `null`, which the `Option` around it takes): any JSON
/// value, handed to the key service to check, so that a string or a fraction is refused
/// naming the field just like a number out of range.
#[derive(Debug)]
struct JsonLimit(LimitInput);

impl<'de> Deserialize<'de> for JsonLimit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        let whole = match &value {
            serde_json::Value::Number(n) => n
                .as_u64()
                .map(i128::from)
                .or_else(|| n.as_i64().map(i128::from)),
            _ => None,
        };
        Ok(Self(match whole {
            Some(n) => LimitInput::Whole(n),
            None => LimitInput::Other(value.to_string()),
        }))
    }
}

fn input(limit: Option<JsonLimit>) -> Option<LimitInput> {
    limit.map(|JsonLimit(v)| v)
}

fn change(limit: Option<Option<JsonLimit>>) -> Option<Option<LimitInput>> {
    limit.map(input)
}

/// A field that is present (possibly `null`) becomes `Some`.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

impl KeyView {
    fn new(keys: &KeyService<'_>, record: &KeyRecord) -> Self {
        let limits = keys.limits(record);
        let now = now_unix();
        Self {
            id: record.id,
            name: record.name.clone(),
            email: record.email.clone(),
            prefix: record.prefix.clone(),
            created_at: record.created_at,
            revoked_at: record.revoked_at,
            expires_at: record.expires_at,
            previous_secret_expires_at: record.previous_secret_expires_at(now),
            active: record.is_usable(now),
            limits: LimitsView {
                monthly_budget: limits.monthly_budget,
                requests_per_minute: limits.requests_per_minute,
                max_concurrent: limits.max_concurrent,
                max_queued: limits.max_queued,
                share: limits.share,
            },
            overrides: OverridesView {
                monthly_budget: record.limits.monthly_budget,
                requests_per_minute: record.limits.requests_per_minute,
                max_concurrent: record.limits.max_concurrent,
                max_queued: record.limits.max_queued,
                share: record.limits.share,
            },
        }
    }
}

fn key_service(state: &AppState) -> KeyService<'_> {
    KeyService::new(state.store(), &state.config().limits)
}

/// A key change takes effect on this server before it is answered: the key table
/// pulls it now (its follow loop would within [`crate::keys::FOLLOW_EVERY`], which is
/// what happens if this pull fails; the failure is logged there).
async fn apply_now(state: &AppState) {
    let _ = state.keys().pull().await;
}

/// The key service's refusals as the API answers them: a bad value is the client's
/// (400, naming the field), an unknown key 404; a failing store is ours (500, logged).
fn api_error(err: KeyError) -> ApiError {
    match err {
        KeyError::InvalidLimit(err) => ApiError::invalid_param(err.limit().name(), err.to_string()),
        KeyError::NotFound(id_or_prefix) => {
            ApiError::KeyNotFound(id_or_prefix.chars().take(64).collect())
        }
        KeyError::GraceTooLong(_) => ApiError::invalid_param("grace_seconds", err.to_string()),
        KeyError::ExpiryOutOfRange(_) => ApiError::invalid_param("expires_at", err.to_string()),
        KeyError::Revoked(_) => ApiError::invalid(err.to_string()),
        KeyError::Store(StoreError::Invalid(message)) => ApiError::invalid(message),
        KeyError::Store(err) => ApiError::internal(err),
    }
}

#[utoipa::path(post, path = "/admin/keys", tag = "admin", request_body = NewKeyRequest,
    responses((status = 201, body = CreatedKey, links(
            ("show_key" = (operation_id = "show_key", parameters(("key" = "$response.body#/prefix")))),
            ("revoke_key" = (operation_id = "revoke_key", parameters(("key" = "$response.body#/prefix")))),
            ("rotate_key" = (operation_id = "rotate_key", parameters(("key" = "$response.body#/prefix")))),
            ("set_limits" = (operation_id = "set_limits", parameters(("key" = "$response.body#/prefix")))),
            ("usage" = (operation_id = "usage", parameters(("key" = "$response.body#/prefix")))),
        )), (status = 400, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 401, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc), (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less). Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn create_key(
    State(state): State<AppState>,
    JsonBody(new): JsonBody<NewKeyRequest>,
) -> Result<(StatusCode, Json<CreatedKey>), ApiError> {
    let limits = NewLimits {
        monthly_budget: input(new.monthly_budget),
        requests_per_minute: input(new.requests_per_minute),
        max_concurrent: input(new.max_concurrent),
        max_queued: input(new.max_queued),
        share: input(new.share),
    };
    let expires_at = new.expires_at.as_ref().map(JsonExpiry::at).transpose()?;
    let keys = key_service(&state);
    let issued = keys
        .create(&new.name, new.email.as_deref(), &limits, expires_at)
        .await
        .map_err(api_error)?;
    apply_now(&state).await;
    Ok((
        StatusCode::CREATED,
        Json(CreatedKey {
            key: KeyView::new(&keys, &issued.record),
            secret: issued.secret.expose().to_owned(),
        }),
    ))
}

#[utoipa::path(get, path = "/admin/keys", tag = "admin",
    responses((status = 200, body = Vec<KeyView>), (status = 401, body = crate::http::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn list_keys(State(state): State<AppState>) -> Result<Json<Vec<KeyView>>, ApiError> {
    let keys = key_service(&state);
    let records = keys.list().await.map_err(api_error)?;
    Ok(Json(
        records.iter().map(|r| KeyView::new(&keys, r)).collect(),
    ))
}

#[utoipa::path(get, path = "/admin/keys/{key}", tag = "admin",
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = KeyView, links(
            ("revoke_key" = (operation_id = "revoke_key", parameters(("key" = "$response.body#/prefix")))),
            ("rotate_key" = (operation_id = "rotate_key", parameters(("key" = "$response.body#/prefix")))),
            ("set_limits" = (operation_id = "set_limits", parameters(("key" = "$response.body#/prefix")))),
            ("usage" = (operation_id = "usage", parameters(("key" = "$response.body#/prefix")))),
        )), (status = 400, description = "`invalid_request`: `{key}` is not UTF-8 once percent-decoded.", body = crate::http::openapi::ErrorEnvelopeDoc), (status = 401, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 404, body = crate::http::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn show_key(
    State(state): State<AppState>,
    Path(key): Path<String>,
) -> Result<Json<KeyView>, ApiError> {
    let keys = key_service(&state);
    let record = keys.find(&key).await.map_err(api_error)?;
    Ok(Json(KeyView::new(&keys, &record)))
}

#[utoipa::path(post, path = "/admin/keys/{key}/revoke", tag = "admin",
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = KeyView), (status = 400, description = "`invalid_request`: `{key}` is not UTF-8 once percent-decoded.", body = crate::http::openapi::ErrorEnvelopeDoc), (status = 401, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 404, body = crate::http::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn revoke_key(
    State(state): State<AppState>,
    Path(key): Path<String>,
) -> Result<Json<KeyView>, ApiError> {
    let keys = key_service(&state);
    let record = keys.revoke(&key).await.map_err(api_error)?;
    apply_now(&state).await;
    Ok(Json(KeyView::new(&keys, &record)))
}

#[utoipa::path(post, path = "/admin/keys/{key}/rotate", tag = "admin", request_body(content = Option<RotateRequest>, description = "Optional: without a body (or with `{}` or `null`) the previous secret keeps working for a day."),
    description = "Issues a new secret for the key, shown only in this response: the same id, prefix, limits, usage, budget, expiry, jobs and saved work. The secret it replaces keeps working until `previous_secret_expires_at` (the grace), then only the new one does. Rotating again during a grace keeps only the secret that rotation replaces; the one before it stops at once. The change reaches every replica through the key change feed.",
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = CreatedKey), (status = 400, description = "`invalid_request`: `grace_seconds` is over 30 days or not a whole number (`param` names it), the key is revoked, the body is not the JSON object documented, or `{key}` is not UTF-8 once percent-decoded.", body = crate::http::openapi::ErrorEnvelopeDoc), (status = 401, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 404, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc), (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less). Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn rotate_key(
    State(state): State<AppState>,
    Path(key): Path<String>,
    request: Request,
) -> Result<Json<CreatedKey>, ApiError> {
    let rotate = if has_body(request.body()) {
        // `null` is the document's other choice (no body at all).
        JsonBody::<Option<RotateRequest>>::from_request(request, &state)
            .await?
            .0
            .unwrap_or_default()
    } else {
        RotateRequest::default()
    };
    let grace = rotate.grace_secs()?;
    let keys = key_service(&state);
    let issued = keys.rotate(&key, grace).await.map_err(api_error)?;
    apply_now(&state).await;
    Ok(Json(CreatedKey {
        key: KeyView::new(&keys, &issued.record),
        secret: issued.secret.expose().to_owned(),
    }))
}

/// Whether a request carries a body to read, as the connection knows it: none for
/// `Content-Length: 0`, for an HTTP/1.1 request with neither a length nor a chunked
/// body, or for an HTTP/2 stream that ended with its headers, whatever the content type
/// says. (Without a body, a rotation takes the default grace.)
fn has_body(body: &axum::body::Body) -> bool {
    use axum::body::HttpBody as _;
    !body.is_end_stream() && body.size_hint().exact() != Some(0)
}

#[utoipa::path(patch, path = "/admin/keys/{key}/limits", tag = "admin", request_body = LimitsPatch,
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = KeyView), (status = 400, description = "`invalid_request`: a limit is out of its bounds or not a whole number, or `expires_at` is not a time (`param` names the field), the body is not the JSON object documented, or `{key}` is not UTF-8 once percent-decoded.", body = crate::http::openapi::ErrorEnvelopeDoc), (status = 401, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 404, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 408, description = "`request_timeout`: the body did not arrive within `connections.body_read_timeout_ms` of its headers.", body = crate::http::openapi::ErrorEnvelopeDoc), (status = 413, description = "`request_too_large`: the body is over 2 MiB (or `max_body_bytes` if that is less). Carries `X-Should-Retry: false`.", body = crate::http::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn set_limits(
    State(state): State<AppState>,
    Path(key): Path<String>,
    JsonBody(patch): JsonBody<LimitsPatch>,
) -> Result<Json<KeyView>, ApiError> {
    let limits = LimitsChange {
        monthly_budget: change(patch.monthly_budget),
        requests_per_minute: change(patch.requests_per_minute),
        max_concurrent: change(patch.max_concurrent),
        max_queued: change(patch.max_queued),
        share: change(patch.share),
    };
    let expires_at = patch
        .expires_at
        .map(|at| at.as_ref().map(JsonExpiry::at).transpose())
        .transpose()?;
    // The expiry's range checked before anything is written, so a bad one changes
    // nothing; the limits are checked (and a bad one refused) before the expiry is.
    if let Some(Some(at)) = expires_at {
        crate::keys::check_expiry(at).map_err(api_error)?;
    }
    let keys = key_service(&state);
    let mut record = keys.set_limits(&key, &limits).await.map_err(api_error)?;
    if let Some(expires_at) = expires_at {
        record = keys.set_expiry(&key, expires_at).await.map_err(api_error)?;
    }
    apply_now(&state).await;
    Ok(Json(KeyView::new(&keys, &record)))
}

#[utoipa::path(get, path = "/admin/keys/{key}/usage", tag = "admin",
    params(("key" = String, Path, description = "Key id or prefix")),
    responses((status = 200, body = KeyUsage), (status = 400, description = "`invalid_request`: `{key}` is not UTF-8 once percent-decoded.", body = crate::http::openapi::ErrorEnvelopeDoc), (status = 401, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 404, body = crate::http::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn usage(
    State(state): State<AppState>,
    Path(key): Path<String>,
) -> Result<Json<KeyUsage>, ApiError> {
    // The live view: the ledger's usage plus what running requests reserve, from the
    // limiter (the key service reads only the ledger).
    let keys = key_service(&state);
    let record = keys.find(&key).await.map_err(api_error)?;
    key_usage(&state, &record, &keys.limits(&record))
        .await
        .map(Json)
}

#[utoipa::path(post, path = "/admin/reload", tag = "admin",
    description = "Reads the config file the server was started with again (as `kill -HUP` does) and applies its nodes: per model, nodes added, removed, reweighted or given another `max_in_flight`. Requests already on a node finish there, even on one removed; nodes that stay keep their state. Other changed settings are listed in `restart_required` and not applied. A file that fails to load or validate changes nothing.",
    responses((status = 200, body = Reloaded), (status = 401, body = crate::http::openapi::ErrorEnvelopeDoc), (status = 422, description = "`invalid_config`: the file does not load or validate (the message names the problem), or the server was not started from a file; nothing was changed.", body = crate::http::openapi::ErrorEnvelopeDoc)),
    security(("admin" = [])))]
pub async fn reload(State(state): State<AppState>) -> Result<Json<Reloaded>, ApiError> {
    crate::reload::reload(&state)
        .await
        .map(Json)
        .map_err(|err| ApiError::InvalidConfig(err.to_string()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use utoipa::PartialSchema as _;

    use super::*;
    use crate::key_limits::Limit;

    /// The bounds the OpenAPI document publishes for the limit fields are the key
    /// service's, for both bodies that take limits.
    #[test]
    fn documented_bounds_are_the_key_services() {
        for (body, schema) in [
            ("NewKeyRequest", NewKeyRequest::schema()),
            ("LimitsPatch", LimitsPatch::schema()),
        ] {
            let schema = serde_json::to_value(schema).unwrap();
            for limit in Limit::ALL {
                let field = &schema["properties"][limit.name()];
                assert_eq!(field["minimum"], limit.min(), "{body}.{limit}: {field}");
                assert_eq!(field["maximum"], limit.max(), "{body}.{limit}: {field}");
            }
        }
    }

    #[test]
    fn limit_fields_take_any_json_value_for_the_service_to_check() {
        let read = |json: &str| {
            let patch: LimitsPatch = serde_json::from_str(json).unwrap();
            change(patch.max_queued)
        };
        assert_eq!(read("{}"), None);
        assert_eq!(read(r#"{"max_queued": null}"#), Some(None));
        assert_eq!(
            read(r#"{"max_queued": 3000000000}"#),
            Some(Some(LimitInput::Whole(3_000_000_000)))
        );
        assert_eq!(
            read(r#"{"max_queued": -1}"#),
            Some(Some(LimitInput::Whole(-1)))
        );
        for (json, text) in [
            (r#"{"max_queued": "5"}"#, r#""5""#),
            (r#"{"max_queued": 1.5}"#, "1.5"),
            (r#"{"max_queued": 5.0}"#, "5.0"),
            (r#"{"max_queued": true}"#, "true"),
            (r#"{"max_queued": [1]}"#, "[1]"),
        ] {
            assert_eq!(
                read(json),
                Some(Some(LimitInput::Other(text.to_owned()))),
                "{json}"
            );
        }
        let new: NewKeyRequest =
            serde_json::from_str(r#"{"name": "n", "requests_per_minute": null}"#).unwrap();
        assert_eq!(input(new.requests_per_minute), None, "null is the default");
    }
}
