//! `POST /v1/chat/completions` exists only to say clearly that it is not supported.

use crate::error::ApiError;

#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "completions",
    responses(
        (status = 400, description = "Always `chat_completions_unsupported`: these are base models with no chat template; use `POST /v1/completions`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 401, description = "`invalid_api_key`: missing, malformed, unknown or revoked key.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`: the key is not among the keys this server holds in memory and the store cannot be reached to look it up. Carries `Retry-After`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = []))
)]
pub async fn chat_completions() -> ApiError {
    ApiError::ChatCompletionsUnsupported
}
