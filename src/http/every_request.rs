//! The one middleware every request of the main listener passes, outside-in:
//! 1. its id ([`envelope::RequestId`]), given before anything else;
//! 2. its span ([`request_span`]), which the rest runs in;
//! 3. its record ([`request_record`]), which sees each error's code and catches a panic
//!    beneath it as a 500;
//! 4. on the way out, the envelope renders the error (if any) with the id, and sets
//!    `X-Request-Id`.
//!
//! One middleware rather than one a step: each `from_fn` layer boxes the future of the
//! rest and moves the request (a few hundred bytes) once more, for every request.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use crate::http::{envelope, request_record, request_span};
use crate::state::AppState;

/// What the middleware needs: the state, and whether requests are traced (fixed at
/// start, as the tracing layers are).
#[derive(Clone)]
pub struct EveryRequest {
    pub state: AppState,
    pub traced: bool,
}

pub async fn every_request(
    State(every): State<EveryRequest>,
    mut request: Request,
    next: Next,
) -> Response {
    let id = envelope::RequestId::generate();
    request.extensions_mut().insert(id.clone());
    let span = request_span::span_of(&request, &id.0, every.traced);
    let response = request_record::recorded(&every.state, &id.0, request, next)
        .instrument(span.clone())
        .await;
    if every.traced {
        span.record("status", i64::from(response.status().as_u16()));
    }
    envelope::enveloped(response, &id).await
}
