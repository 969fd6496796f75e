//! What a completion comes to, in the core's own terms: the answer to relay (read
//! whole, streamed, or committed before a sleeping model has booted) or a typed error,
//! each with the backend that served or failed it. The front door renders it as HTTP
//! (`http::routes::completions`); a job's run reads it as it is (`jobs::run`).

use std::fmt;
use std::io;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::relay::Relayed;
use crate::error::ApiError;
use crate::fleet::Node;
use crate::upstream::Served;

/// A completion's outcome.
pub type Outcome = Result<Completed, Failed>;

/// A completion the node accepted: its answer, on its way.
pub struct Completed {
    pub answer: Answer,
    pub tags: Tags,
}

/// A completion that ended in an error before any of an answer was relayed.
pub struct Failed {
    pub error: ApiError,
    /// Whether a node may have received the request (and run it). Only a request that
    /// provably reached no node may be run again without the risk of running it twice.
    pub sent: bool,
    pub tags: Tags,
}

impl Failed {
    /// Refused before a node could have it: no tags.
    pub fn unsent(error: ApiError) -> Self {
        Self {
            error,
            sent: false,
            tags: Tags::default(),
        }
    }
}

/// Which backend served (or failed) a completion, and how its `max_tokens` was cut.
#[derive(Clone, Default)]
pub struct Tags {
    /// What the model's nodes serve (the checkpoint), once one has said it.
    pub served: Option<Arc<Served>>,
    /// The GPU node that ran (or failed) the request.
    pub node: Option<Arc<Node>>,
    pub clamp: Option<Clamp>,
}

/// `max_tokens` cut by the request window or the key's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clamp {
    /// What the client asked for, or the default injected for it.
    pub requested: u64,
    pub applied: u64,
    pub deadline: bool,
    pub budget: bool,
    /// Whether `requested` is the injected default.
    pub default: bool,
}

/// `requested=N,applied=M,reason=budget|deadline|deadline+budget,source=client|default`.
impl fmt::Display for Clamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reason = match (self.deadline, self.budget) {
            (true, true) => "deadline+budget",
            (true, false) => "deadline",
            _ => "budget",
        };
        let source = if self.default { "default" } else { "client" };
        write!(
            f,
            "requested={},applied={},reason={reason},source={source}",
            self.requested, self.applied
        )
    }
}

/// The answer of a completion the node accepted.
#[expect(
    clippy::large_enum_variant,
    reason = "moved a few times, once per request; the front door boxes a stream once as its body, and boxing it here too would add an allocation a stream"
)]
pub enum Answer {
    /// The node's answer, relayed as it is.
    Relayed(Relayed),
    /// The model was asleep: the answer is committed (a 200) before its node has
    /// booted, and follows as events.
    Booting(Booting),
}

/// An answer committed while its model boots.
pub struct Booting {
    /// Whether the client asked for a stream (the keep-alives and an error are sent as
    /// a stream's would be).
    pub stream: bool,
    pub events: mpsc::Receiver<BootEvent>,
}

/// What a booting answer sends, in order: keep-alives while the model boots, then the
/// node's answer in pieces, or an error in place of the rest.
pub enum BootEvent {
    /// Nothing yet: the connection is kept alive.
    KeepAlive,
    Piece(Bytes),
    /// The request failed after the answer was committed (the boot timed out, the node
    /// failed it): the error goes in the body.
    Failed(ApiError),
    /// The node's answer was cut short mid-body.
    Cut(io::Error),
}
