//! Answers for requests no route takes: unknown paths and wrong methods.

use axum::extract::Request;

use crate::error::ApiError;

pub async fn not_found(request: Request) -> ApiError {
    ApiError::NotFound {
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
    }
}

pub async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::MethodNotAllowed {
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
    }
}
