//! State shared by the handlers and the [`MockVllm`](super::MockVllm) handle: the
//! failure mode, the request log, the in-flight/cancelled counters, the gate, the batch
//! (`--max-num-seqs`) and the prefix cache.
//! Counters and the gate are `watch` channels so waiters never poll.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::config::{FailureMode, MockConfig, ReceivedRequest};
use super::listener::ListenerControl;
use super::lock::lock;
use super::model::ToyModel;
use super::prefix_cache::PrefixCache;
use super::tokenizer::Tokenizer;

pub(crate) struct Shared {
    pub config: MockConfig,
    pub tokenizer: Tokenizer,
    pub model: ToyModel,
    pub listener: ListenerControl,
    pub prefix_cache: PrefixCache,
    /// When the server started (seconds since the epoch), for the counters' `_created`.
    pub started_secs: u64,
    /// Held while a prompt is prefilled: one prefill at a time.
    prefill: tokio::sync::Mutex<()>,
    /// Requests waiting for the prefill: part of vLLM's `num_requests_waiting`.
    prefill_queue: AtomicUsize,
    /// With `max_num_seqs`: a place in the batch per request decoded at once (the
    /// semaphore is fair: first come, first served).
    batch: Option<Arc<Semaphore>>,
    /// Requests waiting for a place in the batch: the rest of `num_requests_waiting`.
    batch_queue: AtomicUsize,
    /// `GET /metrics` requests answered.
    pub metrics_read: AtomicUsize,
    failure: Mutex<FailureMode>,
    received: Mutex<Vec<ReceivedRequest>>,
    in_flight: watch::Sender<usize>,
    cancelled: watch::Sender<usize>,
    /// `true` while the gate is open.
    gate: watch::Sender<bool>,
    /// Bytes of never-ending bodies sent (the `Endless` mode).
    pub endless_sent: AtomicU64,
}

impl Shared {
    pub fn new(config: MockConfig, listener: ListenerControl) -> Self {
        let tokenizer = Tokenizer::new(config.vocab_size);
        let model = ToyModel::new(&tokenizer);
        Self {
            prefix_cache: PrefixCache::new(config.prefix_cache_tokens),
            prefill: tokio::sync::Mutex::new(()),
            prefill_queue: AtomicUsize::new(0),
            batch: config
                .max_num_seqs
                .map(|n| Arc::new(Semaphore::new(n as usize))),
            batch_queue: AtomicUsize::new(0),
            metrics_read: AtomicUsize::new(0),
            started_secs: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            config,
            tokenizer,
            model,
            listener,
            failure: Mutex::new(FailureMode::None),
            received: Mutex::new(Vec::new()),
            in_flight: watch::Sender::new(0),
            cancelled: watch::Sender::new(0),
            gate: watch::Sender::new(true),
            endless_sent: AtomicU64::new(0),
        }
    }

    pub fn failure(&self) -> FailureMode {
        lock(&self.failure).clone()
    }

    /// Never returns in the `Hang` mode (a wedged server answers nothing).
    pub async fn hang_if_wedged(&self) {
        if self.failure() == FailureMode::Hang {
            std::future::pending::<()>().await;
        }
    }

    pub fn set_failure(&self, mode: FailureMode) {
        let refuse = mode == FailureMode::Refuse;
        *lock(&self.failure) = mode;
        if refuse {
            self.listener.close();
        } else if let Err(e) = self.listener.reopen() {
            tracing::error!(error = %e, "mock-vllm could not reopen its listener");
        }
    }

    pub fn record(&self, request: ReceivedRequest) {
        lock(&self.received).push(request);
    }

    pub fn received(&self) -> Vec<ReceivedRequest> {
        lock(&self.received).clone()
    }

    pub fn in_flight(&self) -> usize {
        *self.in_flight.borrow()
    }

    pub fn cancelled(&self) -> usize {
        *self.cancelled.borrow()
    }

    pub async fn wait_in_flight(&self, n: usize) {
        // The sender lives as long as `self`, so this only returns once the count is reached.
        let _ = self.in_flight.subscribe().wait_for(|&v| v >= n).await;
    }

    pub async fn wait_cancelled(&self, n: usize) {
        let _ = self.cancelled.subscribe().wait_for(|&v| v >= n).await;
    }

    pub fn set_gate(&self, open: bool) {
        self.gate.send_replace(open);
    }

    /// Looks the prompts up in the prefix cache and prefills what it misses, after the
    /// prefills before.
    pub async fn prefill(&self, prompts: &[&[u32]]) {
        let uncached: usize = prompts
            .iter()
            .map(|ids| ids.len() - self.prefix_cache.query(ids))
            .sum();
        let time = self.config.prefill_per_token * uncached as u32;
        if !time.is_zero() {
            let queued = Counted::new(&self.prefill_queue);
            let engine = self.prefill.lock().await;
            drop(queued);
            tokio::time::sleep(time).await;
            drop(engine);
        }
    }

    /// Requests waiting for a place in the batch or for their prefill to start:
    /// `vllm:num_requests_waiting`.
    pub fn waiting(&self) -> usize {
        self.batch_queue.load(Ordering::Relaxed) + self.prefill_queue.load(Ordering::Relaxed)
    }

    /// `vllm:num_requests_running`: the requests holding a place in the batch; without
    /// `max_num_seqs`, every completion in flight.
    pub fn running(&self) -> usize {
        match (&self.batch, self.config.max_num_seqs) {
            (Some(batch), Some(n)) => (n as usize).saturating_sub(batch.available_permits()),
            _ => self.in_flight(),
        }
    }

    /// `vllm:kv_cache_usage_perc`: with `max_num_seqs`, the share of the batch in use;
    /// else a made-up but monotone 1% per running request.
    pub fn kv_cache_usage(&self) -> f64 {
        let running = self.running();
        match self.config.max_num_seqs {
            Some(n) => (running as f64 / f64::from(n)).min(1.0),
            None => (running.min(100) as f64) / 100.0,
        }
    }

    pub async fn gate_passed(&self) {
        let _ = self.gate.subscribe().wait_for(|&open| open).await;
    }
}

/// Counts one while it lives (also when the request is dropped while waiting).
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts one /v1/completions request as in flight for its lifetime. Dropped without
/// [`finish`](Self::finish) — the handler future or the response body stream was dropped
/// because the client went away — it counts the request as cancelled.
pub(crate) struct InFlight {
    shared: Arc<Shared>,
    finished: bool,
    /// Its place in the batch, once it has one (with `max_num_seqs`).
    scheduled: Option<OwnedSemaphorePermit>,
}

impl InFlight {
    pub fn enter(shared: &Arc<Shared>) -> Self {
        shared.in_flight.send_modify(|n| *n += 1);
        Self {
            shared: Arc::clone(shared),
            finished: false,
            scheduled: None,
        }
    }

    /// Waits for a place in the batch (with `max_num_seqs`), after the requests that
    /// came before; it is held until the response ends or the client goes away.
    pub async fn schedule(&mut self) {
        let Some(batch) = &self.shared.batch else {
            return;
        };
        let queued = Counted::new(&self.shared.batch_queue);
        // The semaphore is never closed.
        self.scheduled = Arc::clone(batch).acquire_owned().await.ok();
        drop(queued);
    }

    /// The response was delivered in full (or cut on purpose by a failure mode).
    pub fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shared.in_flight.send_modify(|n| *n -= 1);
        if !self.finished {
            self.shared.cancelled.send_modify(|n| *n += 1);
        }
    }
}
