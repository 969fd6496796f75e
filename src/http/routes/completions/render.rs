//! A completion's outcome as HTTP: the node's status, content type and body as they
//! came (a streamed body piece by piece, with no layer of its own per frame), the
//! upstream's model and GPU in `X-Acs-Upstream-Model` / `X-Acs-Upstream-Gpu`, a cut
//! `max_tokens` in `X-Acs-Max-Tokens-Clamped`, and an error as its envelope.
//!
//! An answer committed while its model boots is a 200 at once, kept alive until the
//! answer flows: an SSE comment line (`: booting`) for streams, a space for JSON (JSON
//! allows leading whitespace). An error after that point goes into the body (the
//! contract's "200*" case, without `X-Acs-Upstream-Error-Kind`): the envelope as the
//! whole JSON body, or as one SSE event followed by `data: [DONE]`, the way vLLM
//! reports an error mid-stream.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Frame;

use crate::completion::outcome::{Answer, BootEvent, Booting, Completed, Failed, Outcome, Tags};
use crate::completion::relay::{Metered, Relayed, RelayedBody};
use crate::contract::{X_ACS_MAX_TOKENS_CLAMPED, X_ACS_UPSTREAM_GPU, X_ACS_UPSTREAM_MODEL};
use crate::error::ApiError;

/// The response to a completion served as request `request_id`.
pub fn render(outcome: Outcome, request_id: &str) -> Response {
    let (mut response, tags) = match outcome {
        Ok(Completed { answer, tags }) => {
            let response = match answer {
                Answer::Relayed(relayed) => relayed_response(relayed),
                Answer::Booting(booting) => booting_response(booting, request_id.to_owned()),
            };
            (response, tags)
        }
        Err(Failed { error, tags, .. }) => (error.into_response(), tags),
    };
    tag(&mut response, &tags);
    response
}

fn tag(response: &mut Response, tags: &Tags) {
    let headers = response.headers_mut();
    let clamp = tags.clamp.map(|clamp| clamp.to_string());
    for (name, value) in [
        (
            X_ACS_UPSTREAM_MODEL,
            tags.served.as_ref().map(|s| s.name.as_str()),
        ),
        (
            X_ACS_UPSTREAM_GPU,
            tags.node.as_ref().map(|n| n.gpu.as_str()),
        ),
        (X_ACS_MAX_TOKENS_CLAMPED, clamp.as_deref()),
    ] {
        if let Some(value) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert(name, value);
        }
    }
}

fn relayed_response(relayed: Relayed) -> Response {
    let Relayed {
        status,
        content_type,
        body,
    } = relayed;
    let body = match body {
        RelayedBody::Whole(bytes) => Body::from(bytes),
        // Boxed as axum's own boxed body, which `Body::new` takes as it is: any other
        // body it wraps in a layer that maps its errors, one more for every frame to pass.
        RelayedBody::Streamed(metered) => Body::new(UnsyncBoxBody::new(Streamed(metered))),
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    if let Some(value) = content_type {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

/// A streamed answer as a body of its own rather than a stream made into one, with
/// axum's error type: one layer less for each of hyper's polls, twice a frame.
struct Streamed(Metered);

impl hyper::body::Body for Streamed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.get_mut()
            .0
            .poll_piece(cx)
            .map(|piece| piece.map(|piece| piece.map(Frame::data).map_err(axum::Error::new)))
    }
}

fn booting_response(booting: Booting, request_id: String) -> Response {
    let Booting { stream, mut events } = booting;
    let content_type = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    let body = futures_util::stream::poll_fn(move |cx| {
        events
            .poll_recv(cx)
            .map(|event| event.map(|event| boot_piece(event, stream, &request_id)))
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, content_type),
            // A compressor would hold the keep-alive bytes back.
            (header::CONTENT_ENCODING, "identity"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

fn boot_piece(event: BootEvent, stream: bool, request_id: &str) -> io::Result<Bytes> {
    match event {
        BootEvent::KeepAlive if stream => Ok(Bytes::from_static(b": booting\n\n")),
        BootEvent::KeepAlive => Ok(Bytes::from_static(b" ")),
        BootEvent::Piece(bytes) => Ok(bytes),
        BootEvent::Failed(err) => Ok(in_body_error(&err, request_id, stream)),
        BootEvent::Cut(err) => Err(err),
    }
}

/// The error envelope as the whole JSON body, or as an SSE event and `[DONE]`.
fn in_body_error(err: &ApiError, request_id: &str, stream: bool) -> Bytes {
    let json = err.body().envelope_json(request_id);
    if !stream {
        return Bytes::from(json);
    }
    let mut event = Vec::with_capacity(json.len() + 32);
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(&json);
    event.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    Bytes::from(event)
}
