//! An admitted request, ready to go: dispatched to a node (`dispatch.rs`), its answer
//! relayed and metered (`relay.rs`).

use std::sync::Arc;

use bytes::Bytes;
use tracing::Instrument;

use super::dispatch::{self, Dispatched, Unanswered, Window};
use super::relay::Relayed;
use super::settle::Settlement;
use super::{cut, relay};
use crate::fleet::{Affinity, Model, Node};
use crate::state::AppState;

/// An admitted request, ready to go to a node.
pub(super) struct Outgoing<'a> {
    pub(super) state: &'a AppState,
    pub(super) model: &'a Model,
    /// Whether the client asked for a stream's usage frame.
    pub(super) include_usage: bool,
    pub(super) body: Bytes,
    /// Where the prompt wants to go (prefix routing).
    pub(super) affinity: Affinity,
    pub(super) window: Window,
}

/// How an admitted request went: relayed by a node (named), or unanswered.
pub(super) type Sent = Result<(Relayed, Arc<Node>), Unanswered>;

impl Outgoing<'_> {
    /// Dispatches to a node and relays its answer; with the node that ran it. A node's
    /// error answer fails as one that reached the node.
    pub(super) async fn send(&self, mut settlement: Settlement) -> Sent {
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
                return Err(failed);
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
        match relayed {
            Ok(relayed) => Ok((relayed, upstream)),
            Err(error) => Err(Unanswered {
                error,
                upstream: Some(upstream),
                sent: true,
            }),
        }
    }
}
