//! The span of one request: method, path and request id; never headers or bodies. The
//! handler runs inside it, so every log line and trace span of the request carries it.
//!
//! Only the handler's future is instrumented, not the response body: tower-http's
//! `TraceLayer` enters its span again for every frame of the body, which for a relayed
//! stream is a registry look-up per SSE frame for nothing. The relay logs nothing while
//! it streams, and the request's line, written when a stream's body ends, enters the
//! span itself (`request_record`, which holds it until then). So the span, and with
//! traces on the request's trace, still covers the whole answer. `every_request` runs
//! the rest of the request in it.

use axum::extract::Request;

use crate::traces;

/// The span of `request`, whose id is `request_id`. With traces on, the span is the root
/// of the request's trace, or continues the client's `traceparent` when
/// `follow_client` (only for an authenticated request, see `every_request`), and the
/// status is recorded into it when the response is ready.
///
/// The key prefix is recorded into it once the key is known (see `auth`); the model
/// (see the completion pipeline) and the status only when `traced`, since a field
/// recorded later costs the log's formatter an allocation per request.
pub fn span_of(request: &Request, request_id: &str, follow_client: bool) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        request_id,
        key_prefix = tracing::field::Empty,
        model = tracing::field::Empty,
        status = tracing::field::Empty,
    );
    if follow_client {
        traces::continue_trace(&span, request.headers());
    }
    span
}
