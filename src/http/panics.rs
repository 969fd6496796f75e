//! A panic while a request is handled is answered as a 500 `internal_error` (which the
//! envelope renders with the request id), not with a dropped connection. The request
//! record does this around everything beneath it, rather than tower-http's catch-panic
//! layer: as a layer of its own that boxes every response body once more, one more
//! layer for every frame of every stream to pass through. As with that layer, a panic
//! while a body is being sent is not caught: the connection ends.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;

use crate::error::ApiError;

/// `answer`, or a 500 if it panics.
pub async fn caught(answer: impl Future<Output = Response>) -> Response {
    AssertUnwindSafe(answer)
        .catch_unwind()
        .await
        .unwrap_or_else(|_| ApiError::internal(anyhow::anyhow!("handler panicked")).into_response())
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;
    use crate::error::ErrorBody;

    #[tokio::test]
    async fn a_panic_is_answered_as_an_internal_error() {
        let answer = caught(async { panic!("a bug") }).await;
        assert_eq!(answer.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let code = answer.extensions().get::<ErrorBody>().map(|e| e.code);
        assert_eq!(code, Some("internal_error"));
    }

    #[tokio::test]
    async fn an_answer_passes_unchanged() {
        let answer = caught(async { StatusCode::IM_A_TEAPOT.into_response() }).await;
        assert_eq!(answer.status(), StatusCode::IM_A_TEAPOT);
    }
}
