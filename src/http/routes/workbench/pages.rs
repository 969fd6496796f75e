//! `GET /workbench`, `GET /loom` and their scripts and style sheet, embedded in the
//! binary: plain HTML, CSS and JavaScript with no build step and nothing loaded from
//! anywhere but fleetgate (the Content-Security-Policy says so to the browser too).
//! The pages need no key to load; they ask for one and keep it in session storage.

use axum::extract::Path;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Only fleetgate's own scripts, styles and API; no inline script, no frames.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The embedded files under `/workbench/assets/`: name, content type, text.
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("assets/style.css"),
    ),
    (
        "common.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/common.js"),
    ),
    (
        "workbench.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/workbench.js"),
    ),
    (
        "loom.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/loom.js"),
    ),
];

pub async fn workbench() -> Response {
    page(include_str!("assets/workbench.html"))
}

pub async fn loom() -> Response {
    page(include_str!("assets/loom.html"))
}

/// `GET /workbench/assets/{name}`.
pub async fn asset(Path(name): Path<String>) -> Result<Response, ApiError> {
    let (_, content_type, text) = ASSETS
        .iter()
        .find(|(asset, _, _)| *asset == name)
        .ok_or_else(|| ApiError::NotFound {
            method: "GET".to_owned(),
            path: format!("/workbench/assets/{}", crate::error::excerpt(&name)),
        })?;
    Ok(served(content_type, text))
}

fn page(html: &'static str) -> Response {
    served("text/html; charset=utf-8", html)
}

fn served(content_type: &'static str, text: &'static str) -> Response {
    let mut response = text.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    // A new binary may bring new assets: revalidate rather than run stale scripts.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}
