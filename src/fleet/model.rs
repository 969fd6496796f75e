//! One configured model: its nodes, the pick among those that are up and have room —
//! the prefix's owner (or its runner-up) with `routing = "prefix"` (`prefix.rs`), else
//! (or when both are overloaded or full) power of two choices by load — and its fleet queue
//! (`fleet.queue_size`, `fleet.queue_timeout_ms`) for when every node that is up is at
//! its `max_in_flight`, served in turn by key (`turns.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use rand::Rng;
use tokio::sync::{Notify, oneshot};

use super::node::{InFlight, Node};
use super::prefix::{self, Affinity, Balance, Decision, PromptStart, Seen};
use super::sleep::Sleep;
use super::turns::{Charge, Counters, Ticket, Turn, Turns};
use crate::backoff::Backoff;
use crate::config::{FleetSettings, ModelConfig, Routing};
use crate::error::ApiError;
use crate::upstream::Served;

pub struct Model {
    pub id: String,
    pub is_default: bool,
    pub max_logprobs: u32,
    /// Worst-case decode speed of one sequence, for the non-streaming window.
    pub decode_tokens_per_second: f64,
    /// Replaced whole by a reload (`change.rs`); a request keeps the node it took, and
    /// each pick loads the set once.
    nodes: ArcSwap<Vec<Arc<Node>>>,
    /// How long a failed node of the model stays ejected, also for one a reload adds.
    backoff: Backoff,
    /// Signalled when a request leaves a node, a node comes up or the nodes change.
    freed: Arc<Notify>,
    /// Requests waiting in this model's fleet queue.
    queued: AtomicU32,
    /// Who goes next when a slot comes free (`turns.rs`).
    turns: Turns<Waiter>,
    queue_size: u32,
    queue_timeout: Duration,
    /// With `routing = "prefix"`: how deep prompts are keyed, when the owner is passed
    /// over, and the prefixes seen recently.
    prefix: Option<PrefixRouting>,
    /// Scale to zero (wake hook, keep-warm), when configured.
    pub sleep: Sleep,
}

struct PrefixRouting {
    depth_bytes: usize,
    balance: Balance,
    seen: Seen,
}

/// Why no node could be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoNode {
    /// No node of the model is up (or the model is asleep).
    NoneUp,
    /// Every node that is up stayed at its `max_in_flight` for the whole queue time,
    /// or the queue was full.
    Busy,
}

impl NoNode {
    pub fn into_error(self, model: &str) -> ApiError {
        ApiError::UpstreamUnavailable(match self {
            Self::NoneUp => format!("No node of model '{model}' is up right now. Retry shortly."),
            Self::Busy => format!(
                "Every node of model '{model}' is at capacity and the wait queue is full or timed out. Retry shortly."
            ),
        })
    }
}

impl Model {
    pub(super) fn new(config: &ModelConfig, fleet: &FleetSettings) -> Self {
        let freed = Arc::new(Notify::new());
        let backoff = Backoff {
            first: Duration::from_millis(fleet.eject_base_ms),
            max: Duration::from_millis(fleet.eject_max_ms),
        };
        Self {
            id: config.id.clone(),
            is_default: config.default,
            max_logprobs: config.max_logprobs,
            decode_tokens_per_second: config.decode_tokens_per_second,
            nodes: ArcSwap::from_pointee(
                config
                    .upstreams
                    .iter()
                    .map(|u| {
                        Node::new(
                            u,
                            backoff,
                            Arc::clone(&freed),
                            config.decode_tokens_per_second,
                        )
                    })
                    .collect(),
            ),
            backoff,
            freed,
            queued: AtomicU32::new(0),
            turns: Turns::new(fleet.queue_order),
            queue_size: fleet.queue_size,
            queue_timeout: Duration::from_millis(fleet.queue_timeout_ms),
            prefix: (config.routing.unwrap_or(fleet.routing) == Routing::Prefix).then_some(
                PrefixRouting {
                    depth_bytes: fleet.prefix_bytes,
                    balance: Balance {
                        abs: fleet.prefix_imbalance_abs,
                        rel: fleet.prefix_imbalance_rel,
                    },
                    seen: Seen::new(fleet.prefix_tracked),
                },
            ),
            sleep: Sleep::new(config),
        }
    }

    /// The nodes now; a reload may replace them meanwhile.
    pub fn nodes(&self) -> Arc<Vec<Arc<Node>>> {
        self.nodes.load_full()
    }

    pub fn node_count(&self) -> usize {
        self.nodes.load().len()
    }

    /// Builds a node for an entry a reload adds (`change.rs`).
    pub(super) fn new_node(&self, config: &crate::config::UpstreamConfig) -> Arc<Node> {
        Node::new(
            config,
            self.backoff,
            Arc::clone(&self.freed),
            self.decode_tokens_per_second,
        )
    }

    /// Puts `nodes` in the place of the model's nodes, and has the requests waiting in
    /// its queue look again (a new node may have room).
    pub(super) fn replace_nodes(&self, nodes: Vec<Arc<Node>>) {
        self.nodes.store(Arc::new(nodes));
        self.freed.notify_waiters();
    }

    /// Whether `node` takes requests: it is up and its model is not asleep.
    pub fn takes_requests(&self, node: &Node) -> bool {
        !self.sleep.is_asleep() && node.health.is_up()
    }

    /// Of `nodes`, those that take requests.
    fn up<'a>(&'a self, nodes: &'a [Arc<Node>]) -> impl Iterator<Item = &'a Arc<Node>> {
        nodes.iter().filter(|u| self.takes_requests(u))
    }

    /// Whether any node takes requests.
    pub fn is_up(&self) -> bool {
        self.up(&self.nodes.load()).next().is_some()
    }

    /// The service its keys have had, which orders its fleet queue (`turns.rs`).
    pub fn service(&self) -> &Arc<Counters> {
        self.turns.counters()
    }

    /// Requests waiting in the fleet queue now.
    pub fn queued(&self) -> u32 {
        self.queued.load(Ordering::Relaxed)
    }

    /// Requests in flight on all nodes.
    pub fn in_flight(&self) -> usize {
        self.nodes.load().iter().map(|u| u.in_flight()).sum()
    }

    /// A node that is up, for questions about the model (`/v1/models`, `/tokenize`);
    /// not counted in flight.
    pub fn any_up(&self) -> Option<Arc<Node>> {
        let nodes = self.nodes.load();
        match self.up(&nodes).count() {
            0 => None,
            n => self
                .up(&nodes)
                .nth(rand::rng().random_range(0..n))
                .map(Arc::clone),
        }
    }

    /// Where a request with this prompt wants to go; called once per request (it
    /// remembers the prompt's prefix as seen).
    pub fn affinity(&self, start: PromptStart<'_>) -> Affinity {
        let Some(routing) = &self.prefix else {
            return Affinity::Load;
        };
        match prefix::key(start, routing.depth_bytes) {
            Some(key) => Affinity::Key {
                key,
                seen: routing.seen.saw(key),
            },
            None => Affinity::NoKey,
        }
    }

    /// A node for the next request, counted in flight from here on and charged to
    /// `turn`'s key, and how it was picked; waits in the fleet queue, for its turn
    /// (`turns.rs`), while every node that is up is full. `exclude`: a node that just
    /// failed this request.
    pub async fn acquire(
        &self,
        exclude: Option<&Arc<Node>>,
        affinity: Affinity,
        turn: Turn,
    ) -> Result<Taken, NoNode> {
        // Nobody waits: no turn to take.
        if self.queued() == 0 {
            match self.try_pick(exclude.map(|node| &**node), affinity) {
                Ok((in_flight, decision)) => {
                    let charge = self.turns.charge_now(turn);
                    return Ok(Taken {
                        in_flight,
                        decision,
                        charge,
                    });
                }
                Err(NoNode::NoneUp) => return Err(NoNode::NoneUp),
                Err(NoNode::Busy) => {}
            }
        }
        let give_up = Instant::now() + self.queue_timeout;
        let _counted = Queued::join(self).ok_or(NoNode::Busy)?;
        let (handed, mut taken) = oneshot::channel();
        let waiter = Waiter {
            exclude: exclude.cloned(),
            affinity,
            handed,
        };
        let ticket = self.turns.lock().join(turn, waiter);
        let place = InLine {
            model: self,
            ticket,
        };
        loop {
            // Registered before handing out, so a slot freed in between is not missed.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            self.hand_out();
            tokio::select! {
                biased;
                given = &mut taken => return given.unwrap_or(Err(NoNode::Busy)),
                () = freed => {}
                () = tokio::time::sleep_until(give_up.into()) => {
                    // Given a node as the time ran out: take it.
                    if place.leave() {
                        return Err(NoNode::Busy);
                    }
                    return taken.try_recv().unwrap_or(Err(NoNode::Busy));
                }
            }
        }
    }

    /// Gives the free slots to the waiting requests whose turn it is, until every node
    /// is full or nobody waits. Whoever notices a slot free runs it (a waiter woken by
    /// `freed`, or one that joins), so no slot stays free while a request waits.
    fn hand_out(&self) {
        let mut queue = self.turns.lock();
        'first: while let Some(first) = queue.first() {
            let mut later = None;
            let mut ticket = first;
            loop {
                let Some(waiter) = queue.what(ticket) else {
                    return;
                };
                match self.try_pick(waiter.exclude.as_deref(), waiter.affinity) {
                    Ok((in_flight, decision)) => {
                        if let Some((waiter, charge)) = queue.served(ticket) {
                            waiter.give(Ok(Taken {
                                in_flight,
                                decision,
                                charge,
                            }));
                        }
                        continue 'first;
                    }
                    Err(NoNode::NoneUp) => {
                        if let Some(waiter) = queue.remove(ticket) {
                            waiter.give(Err(NoNode::NoneUp));
                        }
                        continue 'first;
                    }
                    Err(NoNode::Busy) => {
                        // Every node full: the rest wait too. Only when the room left is
                        // on the node this request must avoid may one after it go.
                        if !self.up(&self.nodes.load()).any(|node| node.has_room()) {
                            return;
                        }
                        let after = later.get_or_insert_with(|| queue.in_order().into_iter());
                        match after.find(|next| *next != first) {
                            Some(next) => ticket = next,
                            None => return,
                        }
                    }
                }
            }
        }
    }

    /// Of `nodes`, those a request may go to: up, and not the one that just failed it.
    fn candidates<'a>(
        &'a self,
        nodes: &'a [Arc<Node>],
        exclude: Option<&'a Node>,
    ) -> impl Iterator<Item = &'a Arc<Node>> {
        self.up(nodes)
            .filter(move |u| !exclude.is_some_and(|e| std::ptr::eq(e, &***u)))
    }

    /// The prefix's owner, or else the node that ranks next for it, unless it is
    /// overloaded (for a new prefix: busier than the lightest node) or full; else power
    /// of two choices.
    fn try_pick(
        &self,
        exclude: Option<&Node>,
        affinity: Affinity,
    ) -> Result<(InFlight, Decision), NoNode> {
        let nodes = self.nodes.load();
        let decision = match (affinity, &self.prefix) {
            (Affinity::Key { key, seen }, Some(routing)) => {
                let balance = if seen {
                    routing.balance
                } else {
                    Balance::STRICT
                };
                match self.try_ranked(&nodes, key, balance, exclude)? {
                    Some(taken) => return Ok(taken),
                    None if seen => Decision::FallbackLoad,
                    None => Decision::NoOwner,
                }
            }
            (Affinity::NoKey, _) => Decision::NoOwner,
            _ => Decision::Load,
        };
        self.try_least_loaded(&nodes, exclude)
            .map(|taken| (taken, decision))
    }

    /// The first of the two candidates with the highest rendezvous scores for `key`
    /// that has room and is not overloaded next to the lightest node with room, counted
    /// in flight. The runner-up takes the owner's overflow, so a prefix too busy for one
    /// node is cached on two (the same two on every replica), not on all of them.
    fn try_ranked(
        &self,
        nodes: &[Arc<Node>],
        key: u64,
        balance: Balance,
        exclude: Option<&Node>,
    ) -> Result<Option<(InFlight, Decision)>, NoNode> {
        let mut ranked: [Option<(f64, &Arc<Node>)>; 2] = [None, None];
        let mut lightest = f64::INFINITY;
        for node in self.candidates(nodes, exclude) {
            let score = prefix::score(key, node.seed, node.weight());
            if ranked[0].is_none_or(|(best, _)| score > best) {
                ranked = [Some((score, node)), ranked[0]];
            } else if ranked[1].is_none_or(|(second, _)| score > second) {
                ranked[1] = Some((score, node));
            }
            if node.has_room() {
                lightest = lightest.min(node.load());
            }
        }
        if ranked[0].is_none() {
            return Err(NoNode::NoneUp);
        }
        let decisions = [Decision::Owner, Decision::RunnerUp];
        for ((_, node), decision) in ranked.into_iter().flatten().zip(decisions) {
            if node.has_room()
                && !balance.overloaded(node.load(), lightest)
                && let Some(taken) = node.try_start()
            {
                return Ok(Some((taken, decision)));
            }
        }
        Ok(None)
    }

    /// Power of two choices among the nodes that are up and have room.
    fn try_least_loaded(
        &self,
        nodes: &[Arc<Node>],
        exclude: Option<&Node>,
    ) -> Result<InFlight, NoNode> {
        let mut open: Vec<&Arc<Node>> = Vec::with_capacity(nodes.len());
        let mut any_up = false;
        for upstream in self.candidates(nodes, exclude) {
            any_up = true;
            if upstream.has_room() {
                open.push(upstream);
            }
        }
        if !any_up {
            return Err(NoNode::NoneUp);
        }
        // Another request may take the last slot between the look and the take: retry
        // with what is left.
        while !open.is_empty() {
            let mut rng = rand::rng();
            let n = open.len();
            let a = rng.random_range(0..n);
            let pick = if n == 1 {
                a
            } else {
                let b = (a + rng.random_range(1..n)) % n;
                if open[b].lighter_than(open[a]) { b } else { a }
            };
            if let Some(taken) = open[pick].try_start() {
                return Ok(taken);
            }
            open.swap_remove(pick);
        }
        Err(NoNode::Busy)
    }

    /// Waits until a node is up (a boot finished), at most until `until`.
    pub async fn wait_up(&self, until: Instant) -> bool {
        loop {
            let came_up = self.freed.notified();
            tokio::pin!(came_up);
            came_up.as_mut().enable();
            if self.is_up() {
                return true;
            }
            if tokio::time::timeout_at(until.into(), came_up)
                .await
                .is_err()
            {
                return self.is_up();
            }
        }
    }

    /// What the first upstream that has answered `/v1/models` serves, if any has.
    pub fn served(&self) -> Option<Arc<Served>> {
        self.nodes.load().iter().find_map(|u| u.served())
    }
}

/// A node taken for a request: counted in flight on it, charged to its key until
/// settled, and how it was picked.
pub struct Taken {
    pub in_flight: InFlight,
    pub decision: Decision,
    pub charge: Charge,
}

/// What a request waiting in line needs to be given a node, and where it is given.
struct Waiter {
    exclude: Option<Arc<Node>>,
    affinity: Affinity,
    handed: oneshot::Sender<Result<Taken, NoNode>>,
}

impl Waiter {
    /// Gives the waiter its node (or its error). Should it have gone meanwhile, the
    /// node taken is dropped here: free again, its key's charge taken back.
    fn give(self, taken: Result<Taken, NoNode>) {
        let _gone = self.handed.send(taken);
    }
}

/// A request's place in line, left on drop (the request gave up or its client went).
struct InLine<'a> {
    model: &'a Model,
    ticket: Ticket,
}

impl InLine<'_> {
    /// Leaves the line; false when the request was given a node first.
    fn leave(&self) -> bool {
        self.model.turns.lock().remove(self.ticket).is_some()
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}

/// A place in a model's fleet queue, given back on drop.
struct Queued<'a>(&'a Model);

impl<'a> Queued<'a> {
    fn join(model: &'a Model) -> Option<Self> {
        model
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < model.queue_size).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(model))
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
    }
}
