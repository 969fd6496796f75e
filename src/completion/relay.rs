//! Relaying the upstream's answer: status and body pass through byte for byte and
//! unbuffered (SSE frames are forwarded as they arrive); an error status is wrapped in
//! our envelope instead.

use axum::body::Body;
use axum::http::header;
use axum::response::Response;

use crate::error::ApiError;
use crate::upstream::upstream_rejection;

/// Response headers worth keeping from the upstream; everything else is hop-by-hop or
/// the upstream server's own business.
const KEPT_HEADERS: [header::HeaderName; 2] = [header::CONTENT_TYPE, header::CONTENT_LENGTH];

pub async fn relay(upstream: reqwest::Response) -> Result<Response, ApiError> {
    if !upstream.status().is_success() {
        return Err(upstream_rejection(upstream).await);
    }
    let mut response = Response::builder().status(upstream.status());
    for name in KEPT_HEADERS {
        if let Some(value) = upstream.headers().get(&name) {
            response = response.header(&name, value);
        }
    }
    // Dropping this body (the client went away) drops the upstream response, which
    // closes its connection, and vLLM aborts the generation.
    response
        .body(Body::from_stream(upstream.bytes_stream()))
        .map_err(ApiError::internal)
}
