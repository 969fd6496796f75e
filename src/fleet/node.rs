//! One vLLM node of a model: its address, weight and capacity (`max_in_flight`, or the
//! limit learned from its load, `hold.rs`), the requests in flight on it, its health
//! (`ejection.rs`), the load it reports (`load.rs`) and what it serves.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use super::decode::DecodeRate;
use super::ejection::Health;
use super::hold::{Hold, Reading};
use super::load::Reported;
use super::prefix;
use crate::backoff::Backoff;
use crate::config::UpstreamConfig;
use crate::error::ApiError;
use crate::upstream::{NodeLoad, QUESTION_TIME, Served, UpstreamClient, UpstreamError};

/// Prompts one gateway has a node's tokenizer count at once: counting runs on the
/// node's API server, beside the requests it serves, so one key's batch of long text
/// prompts must not queue it up. More wait their turn (within [`QUESTION_TIME`]).
pub const TOKENIZE_PER_NODE: usize = 4;

/// One vLLM server.
pub struct Node {
    /// Base URL without a trailing slash.
    pub url: String,
    /// Label returned in `X-Acs-Upstream-Gpu`.
    pub gpu: String,
    /// Relative capacity: the upstream's load is its in-flight count over its weight.
    /// Atomic (like `max_in_flight`) so that a reload changes it in place (`reload.rs`).
    weight: AtomicU32,
    /// Its identity in prefix routing's rendezvous ranking (`prefix.rs`).
    pub(super) seed: u64,
    /// [`UNLIMITED`] when none is configured.
    max_in_flight: AtomicUsize,
    /// Requests sent to this upstream and not yet settled.
    in_flight: AtomicUsize,
    pub health: Health,
    /// What the node last reported about its own queue and KV cache.
    pub reported: Reported,
    /// Without `max_in_flight`: the limit learned from what it reports.
    hold: Hold,
    /// How fast a sequence decodes here, learned from its answers.
    pub decode: DecodeRate,
    /// The model's `freed`.
    freed: Arc<Notify>,
    served: RwLock<Option<Arc<Served>>>,
    /// Permits to ask its `/tokenize` ([`TOKENIZE_PER_NODE`]).
    tokenizing: Semaphore,
}

/// The `max_in_flight` of a node that has none.
const UNLIMITED: usize = usize::MAX;

fn limit(config: &UpstreamConfig) -> usize {
    config.max_in_flight.map_or(UNLIMITED, |m| m as usize)
}

/// Counts a request as in flight on its upstream while it lives.
pub struct InFlight(Arc<Node>);

impl InFlight {
    pub fn upstream(&self) -> &Arc<Node> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        // Every waiter looks again: one woken alone might be a failover that must avoid
        // this very node, while another could have used the slot.
        self.0.freed.notify_waiters();
    }
}

impl Node {
    /// `decode_guess`: its model's `decode_tokens_per_second`, until it has answered.
    pub(super) fn new(
        config: &UpstreamConfig,
        backoff: Backoff,
        freed: Arc<Notify>,
        decode_guess: f64,
    ) -> Arc<Self> {
        Arc::new(Self {
            url: config.url.trim_end_matches('/').to_owned(),
            gpu: config.gpu.clone(),
            weight: AtomicU32::new(config.weight),
            seed: prefix::seed(config.url.trim_end_matches('/')),
            max_in_flight: AtomicUsize::new(limit(config)),
            in_flight: AtomicUsize::new(0),
            health: Health::new(backoff),
            reported: Reported::default(),
            hold: Hold::default(),
            decode: DecodeRate::new(decode_guess),
            freed,
            served: RwLock::new(None),
            tokenizing: Semaphore::new(TOKENIZE_PER_NODE),
        })
    }

    /// Takes the weight and `max_in_flight` of a reloaded entry for this node; what is
    /// in flight stays counted.
    pub(super) fn reconfigure(&self, config: &UpstreamConfig) {
        self.weight.store(config.weight, Ordering::Relaxed);
        self.max_in_flight.store(limit(config), Ordering::Relaxed);
    }

    pub fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    pub fn max_in_flight(&self) -> Option<u32> {
        match self.max_in_flight.load(Ordering::Relaxed) {
            UNLIMITED => None,
            limit => u32::try_from(limit).ok(),
        }
    }

    /// The most requests in flight here: `max_in_flight`, else the limit learned
    /// (`hold.rs`), else [`UNLIMITED`].
    fn limit(&self) -> usize {
        match self.max_in_flight.load(Ordering::Relaxed) {
            UNLIMITED => self.hold.limit().unwrap_or(UNLIMITED),
            limit => limit,
        }
    }

    /// The limit learned from the node's load that holds requests here now: `None`
    /// while none is learned, or with `max_in_flight` set.
    pub fn hold_limit(&self) -> Option<usize> {
        self.max_in_flight()
            .map_or_else(|| self.hold.limit(), |_| None)
    }

    /// Takes a reading of the node's `/metrics`: kept as what it reports, and, with
    /// `learn` (`fleet.hold = "auto"`) on a node without `max_in_flight`, learned from
    /// (`hold.rs`). When that lets more requests through, the model's waiting requests
    /// look again.
    pub fn observe(&self, load: NodeLoad, learn: bool) {
        self.reported.set(load);
        let rose = if learn && self.max_in_flight().is_none() {
            let reading = Reading {
                own: self.in_flight(),
                running: load.running,
                waiting: load.waiting,
                kv_permille: self.reported.kv_permille(),
            };
            self.hold.observe(reading, Instant::now())
        } else {
            self.hold.forget()
        };
        if rose {
            self.freed.notify_waiters();
        }
    }

    /// Counts one more request in flight here, unless the node is at its limit
    /// (`max_in_flight`, or the one learned).
    pub(super) fn try_start(self: &Arc<Self>) -> Option<InFlight> {
        let limit = self.limit();
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| InFlight(Arc::clone(self)))
    }

    pub(super) fn has_room(&self) -> bool {
        self.in_flight() < self.limit()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Cancelled if the node is found dead while a request is on it.
    pub fn lost(&self) -> CancellationToken {
        self.health.lost()
    }

    /// The node came up again: wake the requests of its model waiting for one. The
    /// limit learned from its load before is forgotten (it may have restarted with
    /// another batch size).
    pub fn announce_up(&self) {
        self.hold.forget();
        self.freed.notify_waiters();
    }

    /// Requests in flight from here plus those waiting in the node's own queue, over
    /// the weight: what prefix routing's balance compares.
    pub(super) fn load(&self) -> f64 {
        (self.in_flight() as f64 + self.reported.waiting() as f64) / f64::from(self.weight())
    }

    /// Whether this upstream is less loaded than `other`: requests in flight from here
    /// plus those waiting in the node's own queue (which counts other replicas' too),
    /// over the weight (compared without division); on a tie, the emptier KV cache.
    pub(super) fn lighter_than(&self, other: &Node) -> bool {
        let load = |u: &Node, w: u32| {
            (u.in_flight() as u128 + u128::from(u.reported.waiting())) * u128::from(w)
        };
        let (mine, theirs) = (load(self, other.weight()), load(other, self.weight()));
        mine < theirs
            || (mine == theirs && self.reported.kv_permille() < other.reported.kv_permille())
    }

    pub fn served(&self) -> Option<Arc<Served>> {
        self.served.read().ok().and_then(|s| s.clone())
    }

    /// What the node serves: remembered, or asked (`GET /v1/models`) and remembered.
    pub async fn discover(&self, client: &UpstreamClient) -> Result<Arc<Served>, UpstreamError> {
        match self.served() {
            Some(served) => Ok(served),
            None => Ok(self.set_served(client.read_served(&self.url).await?)),
        }
    }

    /// Counts a text prompt's tokens with the node's tokenizer, at most
    /// [`TOKENIZE_PER_NODE`] at a time; waiting for a turn and the answer each take at
    /// most [`QUESTION_TIME`].
    pub async fn count_tokens(
        &self,
        client: &UpstreamClient,
        served: &Served,
        prompt: &str,
        add_special_tokens: bool,
    ) -> Result<u64, ApiError> {
        let Ok(Ok(_turn)) = tokio::time::timeout(QUESTION_TIME, self.tokenizing.acquire()).await
        else {
            return Err(ApiError::UpstreamUnavailable(format!(
                "The model server's tokenizer is busy: no turn to count the prompt's tokens within {} s. Retry shortly.",
                QUESTION_TIME.as_secs()
            )));
        };
        client
            .count_tokens(&self.url, served, prompt, add_special_tokens)
            .await
    }

    pub fn set_served(&self, served: Served) -> Arc<Served> {
        let served = Arc::new(served);
        if let Ok(mut slot) = self.served.write() {
            *slot = Some(Arc::clone(&served));
        }
        served
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn node(weight: u32) -> Arc<Node> {
        node_with(weight, None, Arc::new(Notify::new()))
    }

    fn node_with(weight: u32, max_in_flight: Option<u32>, freed: Arc<Notify>) -> Arc<Node> {
        let config = UpstreamConfig {
            url: "http://127.0.0.1:1".into(),
            gpu: "g".into(),
            weight,
            max_in_flight,
        };
        let backoff = Backoff {
            first: Duration::from_secs(1),
            max: Duration::from_secs(1),
        };
        Node::new(&config, backoff, freed, 26.0)
    }

    fn load(running: u64, waiting: u64) -> NodeLoad {
        NodeLoad {
            running,
            waiting,
            kv_cache_usage: 0.5,
            ..NodeLoad::default()
        }
    }

    #[tokio::test]
    async fn a_queueing_node_holds_what_it_cannot_run_and_wakes_waiters_when_it_can() {
        let freed = Arc::new(Notify::new());
        let node = node_with(1, None, Arc::clone(&freed));
        let mut sent: Vec<_> = (0..6).map(|_| node.try_start().unwrap()).collect();
        node.observe(load(6, 0), true);
        assert!(node.has_room(), "nothing waiting: never held");
        node.observe(load(4, 2), true);
        assert_eq!(node.hold_limit(), Some(4));
        assert!(!node.has_room() && node.try_start().is_none());
        // Two finish, the two waiting run: at the limit.
        sent.truncate(4);
        assert!(!node.has_room());
        // A calm reading at the limit lifts it, and wakes the waiting requests.
        let woken = freed.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        node.observe(load(4, 0), true);
        assert_eq!(node.hold_limit(), Some(5));
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .unwrap();
        assert!(node.try_start().is_some());
    }

    #[test]
    fn max_in_flight_or_hold_off_learns_nothing() {
        let freed = Arc::new(Notify::new());
        let capped = node_with(1, Some(10), Arc::clone(&freed));
        let _sent: Vec<_> = (0..6).map(|_| capped.try_start().unwrap()).collect();
        capped.observe(load(4, 2), true);
        assert_eq!(capped.hold_limit(), None);
        assert!(capped.has_room(), "max_in_flight wins");
        let off = node(1);
        let _sent: Vec<_> = (0..6).map(|_| off.try_start().unwrap()).collect();
        off.observe(load(4, 2), false);
        assert_eq!(off.hold_limit(), None);
        assert!(off.has_room());
        // Learned, then turned off: forgotten.
        let learned = node(1);
        let _sent: Vec<_> = (0..6).map(|_| learned.try_start().unwrap()).collect();
        learned.observe(load(4, 2), true);
        assert_eq!(learned.hold_limit(), Some(4));
        learned.observe(load(4, 2), false);
        assert!(learned.has_room());
    }

    #[test]
    fn the_lighter_node_counts_its_own_queue_weight_and_kv_cache() {
        let (a, b) = (node(1), node(1));
        let _busy = a.try_start();
        assert!(b.lighter_than(&a), "fewer in flight");
        b.reported.set(NodeLoad {
            waiting: 2,
            kv_cache_usage: 0.0,
            ..NodeLoad::default()
        });
        assert!(
            a.lighter_than(&b),
            "two waiting in vLLM's queue outweigh one in flight"
        );
        let heavy = node(3);
        let _three: Vec<_> = (0..3).map(|_| heavy.try_start()).collect();
        assert!(
            !heavy.lighter_than(&a) && !a.lighter_than(&heavy),
            "3/3 = 1/1"
        );
        let (c, d) = (node(1), node(1));
        c.reported.set(NodeLoad {
            waiting: 0,
            kv_cache_usage: 0.9,
            ..NodeLoad::default()
        });
        assert!(d.lighter_than(&c), "a tie goes to the emptier KV cache");
    }
}
