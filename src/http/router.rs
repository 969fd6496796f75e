//! The routes: the key-protected `/v1` API, the admin API, the ops routes (`/health`,
//! `/ready`, `/live`, `/metrics`), the docs and the Workbench's and Loom's pages, under
//! the layers every request passes. `main` and the tests both build the service here;
//! the handlers know nothing of it.

use axum::middleware;
use axum::routing::get;
use axum::{Extension, Router};
use tower_http::compression::Compression;
use tower_http::compression::predicate::{And, NotForContentType, Predicate, SizeAbove};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use utoipa_swagger_ui::SwaggerUi;

use crate::http::body::Reading;
use crate::http::every_request::{self, EveryRequest};
use crate::http::openapi::ApiDoc;
use crate::http::routes::{admin, completions, harvest, models, ops, usage, workbench};
use crate::http::{auth, fallback};
use crate::state::AppState;

/// Answers shorter than this go out uncompressed: a gzip stream's state (a few hundred
/// KiB, zeroed for every response) costs far more than the few hundred bytes it would
/// save, and a short answer fits in one TCP segment either way.
const COMPRESS_MIN_BYTES: u64 = 1024;

/// What [`compressed`] compresses: answers of at least [`COMPRESS_MIN_BYTES`], neither
/// gRPC, images nor event streams.
pub type CompressWhen =
    And<And<And<SizeAbove, NotForContentType>, NotForContentType>, NotForContentType>;

/// [`build_router`]'s service with its answers compressed, as the listener
/// (`connections`) serves it: the final body is compressed, error envelopes included,
/// and event streams and short answers are left alone. As the router's own outermost
/// layer, compression would have its response body boxed once more (a router's layers
/// answer with a boxed body): one more layer for every frame of every stream to pass.
pub fn compressed<S>(service: S) -> Compression<S, CompressWhen> {
    Compression::new(service).compress_when(
        SizeAbove::new(COMPRESS_MIN_BYTES)
            .and(NotForContentType::GRPC)
            .and(NotForContentType::IMAGES)
            .and(NotForContentType::SSE),
    )
}

/// The key-protected `/v1` routes, with the Workbench's (`workbench::api_routes`, under
/// the layers the caller gives them).
fn v1_routes(workbench: OpenApiRouter<AppState>) -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(completions::create_completion))
        .routes(routes!(completions::chat::chat_completions))
        .routes(routes!(models::list_models))
        .routes(routes!(usage::own_usage))
        .routes(routes!(harvest::list))
        .routes(routes!(harvest::harvest, harvest::cancel))
        .merge(workbench)
}

/// Every documented route, for the OpenAPI document.
fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(v1_routes(workbench::api_routes()))
        .merge(admin::admin_routes())
        .routes(routes!(ops::health))
        .routes(routes!(ops::ready))
        .routes(routes!(ops::live))
}

/// The OpenAPI document, as served at `/openapi.json` and checked in at
/// `openapi/openapi.json`: the annotations of the routes above over [`ApiDoc`].
pub fn openapi_document() -> utoipa::openapi::OpenApi {
    api_routes().split_for_parts().1
}

/// The ops listener's routes: `/metrics`, `/health`, `/ready` and `/live`, nothing else.
pub fn build_ops_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(ops::metrics))
        .route("/health", get(ops::health))
        .route("/ready", get(ops::ready))
        .route("/live", get(ops::live))
        .fallback(fallback::not_found)
        .layer(middleware::from_fn(every_request::envelope))
        .with_state(state)
}

pub fn build_router(state: AppState) -> Router {
    // The key is checked first (the outer layer), then the Workbench's routes count
    // against its rate.
    let workbench = workbench::api_routes().route_layer(middleware::from_fn_with_state(
        state.clone(),
        workbench::rate::count_against_rate,
    ));
    let (v1, _) = v1_routes(workbench)
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ))
        .split_for_parts();
    // On its own listener, when it has one (`admin_listen`); else here.
    let admin = match state.config().admin_listen {
        Some(_) => Router::new(),
        None => guarded_admin(&state),
    };
    // Ops routes without a key; `/metrics` is not in the OpenAPI document.
    let (open, _) = OpenApiRouter::new()
        .routes(routes!(ops::health))
        .routes(routes!(ops::ready))
        .routes(routes!(ops::live))
        .route("/metrics", get(ops::metrics))
        // The Workbench's and Loom's pages: they load without a key and ask for one.
        .route("/workbench", get(workbench::pages::workbench))
        .route("/loom", get(workbench::pages::loom))
        .route("/workbench/assets/{name}", get(workbench::pages::asset))
        .split_for_parts();
    let swagger = SwaggerUi::new("/swagger").url("/openapi.json", openapi_document());
    let every = EveryRequest {
        state: state.clone(),
        traced: state.config().traces.enabled(),
    };

    // Compression goes around this (see `compressed`); `every_request` is the one layer
    // every request passes: its id, span, record and envelope.
    served(
        Router::new()
            .merge(v1)
            .merge(admin)
            .merge(open)
            .merge(swagger),
        every,
        state,
    )
}

/// The admin listener's routes (`admin_listen`): the admin API, nothing else, with the
/// layers of the API's.
pub fn build_admin_router(state: AppState) -> Router {
    let every = EveryRequest {
        state: state.clone(),
        traced: state.config().traces.enabled(),
    };
    served(guarded_admin(&state), every, state)
}

/// The admin API behind its token.
fn guarded_admin(state: &AppState) -> Router<AppState> {
    admin::admin_routes()
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            admin::require_admin,
        ))
        .split_for_parts()
        .0
}

/// `routes` with the fallbacks and the one layer every request passes, and the bound on
/// what each key's bodies hold while read (`body.rs`).
fn served(routes: Router<AppState>, every: EveryRequest, state: AppState) -> Router {
    let reading = Reading::new(state.config().connections.reading_bytes_per_key);
    routes
        .fallback(fallback::not_found)
        .method_not_allowed_fallback(fallback::method_not_allowed)
        .layer(Extension(reading))
        .layer(middleware::from_fn_with_state(
            every,
            every_request::every_request,
        ))
        .with_state(state)
}
