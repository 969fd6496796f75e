//! An [`ApiError`] as a response: its status and the headers it tells a client by
//! (`Retry-After`, `X-Should-Retry`, `X-Acs-Upstream-Error-Kind`), with its
//! [`ErrorBody`](crate::error::ErrorBody) as an extension for the envelope (in
//! `every_request`), which owns the request id, to render.

use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};

use crate::contract::{X_ACS_UPSTREAM_ERROR_KIND, X_SHOULD_RETRY};
use crate::error::ApiError;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Self::Internal(err) = &self {
            // Logged once, here at the edge; the client sees only the request id.
            tracing::error!(error = %format!("{err:#}"), "internal error");
        }
        let mut response = self.status().into_response();
        let headers = response.headers_mut();
        if self.retry_futile() {
            headers.insert(X_SHOULD_RETRY, HeaderValue::from_static("false"));
        }
        if let Some(kind) = self.upstream_error_kind() {
            headers.insert(X_ACS_UPSTREAM_ERROR_KIND, HeaderValue::from_static(kind));
        }
        if let Some(wait) = self.retry_after() {
            headers.insert(axum::http::header::RETRY_AFTER, wait.as_secs().into());
        }
        response.extensions_mut().insert(self.body());
        response
    }
}
