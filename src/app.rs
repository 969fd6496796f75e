//! Application state and the router that `main` and the tests both build.

use std::sync::Arc;

use axum::Router;
use axum::middleware;
use axum::routing::get;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::CompressionLayer;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use utoipa_swagger_ui::SwaggerUi;

use crate::admission::Limiter;
use crate::config::Config;
use crate::error::ApiError;
use crate::fleet::Fleet;
use crate::http::{auth, envelope, fallback, request_record};
use crate::metrics::{self, Metrics};
use crate::openapi::ApiDoc;
use crate::request_log::RequestLog;
use crate::store::Store;
use crate::upstream::UpstreamClient;
use crate::{admin, completion, health, models, usage};

#[derive(Clone)]
pub struct AppState(Arc<Inner>);

struct Inner {
    config: Config,
    /// Live per-key counters: rate, slots, queue, budget reservations.
    limiter: Arc<dyn Limiter>,
    /// Cancelled when the shutdown grace period is over: bodies still streaming end.
    draining: CancellationToken,
    /// The request metadata log's writer.
    request_log: RequestLog,
    /// Work that must finish even when its request is gone (settling, leaving a queue);
    /// waited for on shutdown.
    tasks: TaskTracker,
    /// Keys (and later usage): SQLite or PostgreSQL.
    store: Arc<dyn Store>,
    /// Models and their upstreams.
    fleet: Fleet,
    /// The pooled HTTP client for all upstreams.
    upstream: UpstreamClient,
    /// The Prometheus registry and its handles (`GET /metrics`).
    metrics: Metrics,
}

impl AppState {
    pub fn new(
        config: Config,
        store: Arc<dyn Store>,
        limiter: Arc<dyn Limiter>,
    ) -> anyhow::Result<Self> {
        let upstream = UpstreamClient::new(&config.upstream)?;
        let fleet = Fleet::new(&config);
        let metrics = Metrics::new(&fleet);
        Ok(Self(Arc::new(Inner {
            config,
            limiter,
            draining: CancellationToken::new(),
            request_log: RequestLog::start(Arc::clone(&store)),
            tasks: TaskTracker::new(),
            store,
            fleet,
            upstream,
            metrics,
        })))
    }

    pub fn config(&self) -> &Config {
        &self.0.config
    }
    pub fn store(&self) -> &dyn Store {
        self.0.store.as_ref()
    }
    pub fn fleet(&self) -> &Fleet {
        &self.0.fleet
    }
    pub fn upstream(&self) -> &UpstreamClient {
        &self.0.upstream
    }
    pub fn limiter(&self) -> &dyn Limiter {
        self.0.limiter.as_ref()
    }
    /// An owned handle on the limiter, for work that outlives the request.
    pub fn limiter_handle(&self) -> Arc<dyn Limiter> {
        Arc::clone(&self.0.limiter)
    }
    pub fn tasks(&self) -> &TaskTracker {
        &self.0.tasks
    }
    pub fn draining(&self) -> &CancellationToken {
        &self.0.draining
    }
    pub fn request_log(&self) -> &RequestLog {
        &self.0.request_log
    }
    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// Learns what every upstream serves, so the first requests need not wait for it.
    /// A node that does not answer starts ejected; the prober re-admits it once it does.
    pub async fn discover_upstreams(&self) {
        let all = self.fleet().upstreams().map(|upstream| async move {
            if let Err(err) = self.upstream().discover(upstream).await {
                upstream.health.request_failed();
                tracing::warn!(upstream = %upstream.url, error = %err, "upstream not ready yet");
            }
        });
        futures_util::future::join_all(all).await;
    }
}

/// The key-protected `/v1` routes.
fn v1_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(completion::create_completion))
        .routes(routes!(completion::chat::chat_completions))
        .routes(routes!(models::list_models))
        .routes(routes!(usage::own_usage))
}

/// Every documented route, for the OpenAPI document.
pub fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(v1_routes())
        .merge(admin::admin_routes())
        .routes(routes!(health::health))
}

/// The ops listener's routes: `/metrics` and `/health`, nothing else.
pub fn build_ops_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics::scrape))
        .route("/health", get(health::health))
        .fallback(fallback::not_found)
        .layer(middleware::from_fn(envelope::envelope))
        .with_state(state)
}

pub fn build_router(state: AppState) -> Router {
    let (v1, _) = v1_routes()
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ))
        .split_for_parts();
    let (admin, _) = admin::admin_routes()
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            admin::require_admin,
        ))
        .split_for_parts();
    // Ops routes without a key; `/metrics` is not in the OpenAPI document.
    let (open, _) = OpenApiRouter::new()
        .routes(routes!(health::health))
        .route("/metrics", get(metrics::scrape))
        .split_for_parts();
    let swagger = SwaggerUi::new("/swagger").url("/openapi.json", crate::openapi::document());

    // Layers run outside-in for requests, inside-out for responses:
    // - compression is outermost so it compresses the final body, error envelopes
    //   included (it leaves text/event-stream alone);
    // - the envelope sets the request id before tracing opens its span, and renders
    //   every error response produced beneath it, panics included;
    // - the request record sits inside the envelope so it sees each error's code before
    //   the envelope renders it, and outside catch-panic so a panic is logged as a 500;
    // - catch-panic turns a panic into a 500 that the envelope then renders.
    Router::new()
        .merge(v1)
        .merge(admin)
        .merge(open)
        .merge(swagger)
        .fallback(fallback::not_found)
        .method_not_allowed_fallback(fallback::method_not_allowed)
        .layer(CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                axum::response::IntoResponse::into_response(ApiError::internal(anyhow::anyhow!(
                    "handler panicked"
                )))
            },
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            request_record::record,
        ))
        .layer(TraceLayer::new_for_http().make_span_with(trace_span))
        .layer(middleware::from_fn(envelope::envelope))
        .layer(CompressionLayer::new())
        .with_state(state)
}

/// The span of one request: method, path and request id; never headers or bodies.
fn trace_span(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    let request_id = request
        .extensions()
        .get::<envelope::RequestId>()
        .map(|id| id.0.as_str())
        .unwrap_or("");
    tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        request_id,
        key_prefix = tracing::field::Empty,
    )
}
