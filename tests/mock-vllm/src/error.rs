//! vLLM's error envelope (the 0.10.1+ form) and the spaced SSE error event.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Clone, Debug)]
pub(crate) struct VllmError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl VllmError {
    /// A `ValueError` in the serving layer or engine: 400 `BadRequestError`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
        }
    }

    /// A pydantic / FastAPI validation error: 400 with the HTTP phrase as type.
    pub fn validation(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "Bad Request",
            message: message.into(),
        }
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
        }
    }

    /// An unexpected exception in the handler (`str(exc)` is usually empty).
    pub fn internal() -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "Internal Server Error",
            message: String::new(),
        }
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    fn body(&self) -> String {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": null,
            "code": self.status.as_u16(),
        }})
        .to_string()
    }
}

impl IntoResponse for VllmError {
    fn into_response(self) -> Response {
        (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body(),
        )
            .into_response()
    }
}

/// The mid-stream error event: Python `json.dumps` with default separators and
/// `ensure_ascii=True`, always 400 / `BadRequestError`.
pub(crate) fn stream_error_event(message: &str) -> String {
    format!(
        "data: {{\"error\": {{\"message\": {}, \"type\": \"BadRequestError\", \"param\": null, \"code\": 400}}}}\n\n",
        ascii_json_string(message)
    )
}

/// A JSON string literal with every non-ASCII character `\u`-escaped.
fn ascii_json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_ascii() && !c.is_ascii_control() => out.push(c),
            c => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spaced_ascii_event() {
        assert_eq!(
            stream_error_event("é\"x"),
            "data: {\"error\": {\"message\": \"\\u00e9\\\"x\", \"type\": \"BadRequestError\", \"param\": null, \"code\": 400}}\n\n"
        );
    }
}
