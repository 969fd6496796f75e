//! `GET /v1/models`: the short ids clients send, with what each one serves.

use axum::Json;
use axum::extract::State;
use futures_util::future::join_all;
use serde::Serialize;
use utoipa::ToSchema;

use crate::contract::FULL_VOCAB_MAX_PROMPT_TOKENS;
use crate::fleet::Model;
use crate::state::AppState;

#[derive(Serialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    object: &'static str,
    data: Vec<ModelCard>,
}

#[derive(Serialize, ToSchema)]
pub struct ModelCard {
    /// The short id to send as `model`.
    id: String,
    /// Always `model`.
    object: &'static str,
    owned_by: &'static str,
    /// True on the model that requests without `model` are routed to.
    default: bool,
    /// The checkpoint currently behind this id (null until a server has answered).
    checkpoint: Option<String>,
    /// Context length in tokens (null until a server has answered).
    max_model_len: Option<u64>,
    capabilities: Capabilities,
}

#[derive(Serialize, ToSchema)]
pub struct Capabilities {
    /// Largest accepted `logprobs`.
    max_logprobs: u32,
    /// Longest prompt, in tokens, accepted with `prompt_logprobs: -1`.
    full_vocab_max_prompt_tokens: u64,
}

#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "models",
    responses(
        (status = 200, description = "The models of this deployment.", body = ModelList),
        (status = 401, description = "`invalid_api_key`.", body = crate::http::openapi::ErrorEnvelopeDoc),
        (status = 503, description = "`store_unavailable`: the key is not among the keys this server holds in memory and the store cannot be reached to look it up. Carries `Retry-After`.", body = crate::http::openapi::ErrorEnvelopeDoc),
    ),
    security(("bearer" = []))
)]
pub async fn list_models(State(state): State<AppState>) -> Json<ModelList> {
    let models = state.fleet().models();
    Json(ModelList {
        object: "list",
        data: join_all(models.iter().map(|m| card(&state, m))).await,
    })
}

async fn card(state: &AppState, model: &Model) -> ModelCard {
    // A model whose servers have not answered yet gets one attempt now.
    let served = match (model.served(), model.any_up()) {
        (Some(served), _) => Some(served),
        (None, Some(node)) => node.discover(state.upstream()).await.ok(),
        (None, None) => None,
    };
    ModelCard {
        id: model.id.clone(),
        object: "model",
        owned_by: "fleetgate",
        default: model.is_default,
        checkpoint: served.as_ref().map(|s| s.name.clone()),
        max_model_len: served.as_ref().map(|s| s.max_model_len),
        capabilities: Capabilities {
            max_logprobs: model.max_logprobs,
            full_vocab_max_prompt_tokens: FULL_VOCAB_MAX_PROMPT_TOKENS,
        },
    }
}
