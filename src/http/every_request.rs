//! The one middleware every request of the main listener passes, outside-in:
//! 1. its id ([`envelope::RequestId`]), given before anything else;
//! 2. its span ([`request_span`]), which the rest runs in; with traces on, it continues
//!    a client's `traceparent` only when the request shows a credential that holds
//!    ([`auth::shows_credential`]): anybody else's sampled flag would make the gateway
//!    export the traces of their noise, whatever `traces.sample_ratio` says. Their
//!    requests start traces of their own, kept at `sample_ratio`;
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

use crate::http::{auth, envelope, request_record, request_span};
use crate::state::AppState;

/// The W3C trace context header a client may send.
const TRACEPARENT: &str = "traceparent";

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
    // The key is looked up only when there is a client trace to follow.
    let follow_client = every.traced
        && request.headers().contains_key(TRACEPARENT)
        && auth::shows_credential(&every.state, request.headers());
    let span = request_span::span_of(&request, &id.0, follow_client);
    let response = request_record::recorded(&every.state, &id.0, request, next)
        .instrument(span.clone())
        .await;
    if every.traced {
        span.record("status", i64::from(response.status().as_u16()));
    }
    envelope::enveloped(response, &id).await
}
