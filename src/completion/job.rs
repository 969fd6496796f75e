//! An admitted request, ready to go: dispatched to a node (`dispatch.rs`), its answer
//! relayed and metered (`relay.rs`).

use std::sync::Arc;

use axum::response::Response;
use bytes::Bytes;
use tracing::Instrument;

use super::dispatch::{self, Dispatched, Window};
use super::settle::Settlement;
use super::{cut, relay};
use crate::error::ApiError;
use crate::fleet::{Affinity, Model, Node};
use crate::state::AppState;

/// An admitted request, ready to go to a node.
pub(super) struct Job<'a> {
    pub(super) state: &'a AppState,
    pub(super) model: &'a Model,
    /// Whether the client asked for a stream's usage frame.
    pub(super) include_usage: bool,
    pub(super) body: Bytes,
    /// Where the prompt wants to go (prefix routing).
    pub(super) affinity: Affinity,
    pub(super) window: Window,
}

impl Job<'_> {
    /// Dispatches to a node and relays its answer; also returns the node that ran (or
    /// failed) the request, and whether a node may have received it (see
    /// [`dispatch::Failed::sent`]; true once an answer is relayed).
    pub(super) async fn run(
        &self,
        mut settlement: Settlement,
    ) -> (Result<Response, ApiError>, Option<Arc<Node>>, bool) {
        let dispatched = match dispatch::dispatch(
            self.state,
            self.model,
            self.body.clone(),
            self.affinity,
            &mut settlement,
            self.window,
        )
        .await
        {
            Ok(dispatched) => dispatched,
            Err(failed) => {
                settlement.release_unused().await;
                return (Err(failed.error), failed.upstream, failed.sent);
            }
        };
        let Dispatched {
            response,
            upstream,
            metrics,
            sent,
        } = dispatched;
        let timing = relay::Timing { metrics, sent };
        let cut = cut::cut(self.state.draining().clone(), upstream.lost());
        let span = tracing::debug_span!("relay");
        let relayed = relay::relay(
            response,
            settlement,
            self.include_usage,
            timing,
            cut,
            span.clone(),
        )
        .instrument(span)
        .await;
        (relayed, Some(upstream), true)
    }
}
