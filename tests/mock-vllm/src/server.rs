//! The [`MockVllm`] handle: starts the axum server and exposes the test controls.

use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::config::{FailureMode, MockConfig, ReceivedRequest};
use super::listener::{KillableStream, ListenerControl};
use super::lock::lock;
use super::state::Shared;
use super::tokenizer::WORD_BASE;
use super::{completions, endpoints};

/// A running mock vLLM server. Cheap to clone; all clones control the same server, which
/// stops when [`shutdown`](Self::shutdown) is called or the last clone is dropped.
#[derive(Clone)]
pub struct MockVllm {
    shared: Arc<Shared>,
    task: Arc<ServerTask>,
}

/// Owns the server task; stopping it also closes the socket and every connection.
struct ServerTask {
    handle: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
}

impl ServerTask {
    fn stop(&self) -> Option<JoinHandle<()>> {
        self.shared.listener.shut_down();
        let handle = lock(&self.handle).take();
        if let Some(handle) = &handle {
            handle.abort();
        }
        handle
    }
}

impl Drop for ServerTask {
    fn drop(&mut self) {
        self.stop();
    }
}

impl MockVllm {
    /// Start on `127.0.0.1:0` (an ephemeral port).
    pub async fn start(config: MockConfig) -> io::Result<MockVllm> {
        Self::start_on(TcpListener::bind("127.0.0.1:0").await?, config).await
    }

    /// Start on an already bound listener.
    pub async fn start_on(listener: TcpListener, config: MockConfig) -> io::Result<MockVllm> {
        if config.vocab_size <= WORD_BASE
            || config.max_model_len == 0
            || config.max_num_seqs == Some(0)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "mock-vllm needs vocab_size > {WORD_BASE}, max_model_len > 0 and max_num_seqs > 0"
                ),
            ));
        }
        let shared = Arc::new(Shared::new(config, ListenerControl::new(listener)?));
        let app = router(Arc::clone(&shared));
        let serve = axum::serve(RefusableListener(Arc::clone(&shared)), app);
        let handle = tokio::spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "mock-vllm server failed");
            }
        });
        Ok(MockVllm {
            task: Arc::new(ServerTask {
                handle: Mutex::new(Some(handle)),
                shared: Arc::clone(&shared),
            }),
            shared,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.shared.listener.addr()
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    pub fn config(&self) -> &MockConfig {
        &self.shared.config
    }

    pub fn set_failure(&self, mode: FailureMode) {
        self.shared.set_failure(mode);
    }

    /// Bytes of never-ending bodies sent so far ([`FailureMode::Endless`]).
    pub fn endless_bytes_sent(&self) -> u64 {
        self.shared
            .endless_sent
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every request received on /v1/completions and /tokenize, in arrival order.
    pub fn received(&self) -> Vec<ReceivedRequest> {
        self.shared.received()
    }

    /// Number of /v1/completions requests whose client went away before the response
    /// finished (the handler future or the response body was dropped early).
    pub fn cancelled(&self) -> usize {
        self.shared.cancelled()
    }

    /// Wait until `cancelled() >= n`.
    pub async fn wait_cancelled(&self, n: usize) {
        self.shared.wait_cancelled(n).await;
    }

    /// Number of /v1/completions requests currently in flight.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight()
    }

    /// `vllm:num_requests_running` now: the requests in the batch (with
    /// [`MockConfig::max_num_seqs`]), else every one in flight.
    pub fn running(&self) -> usize {
        self.shared.running()
    }

    /// `vllm:num_requests_waiting` now: the requests waiting for a place in the batch
    /// or for their prefill.
    pub fn waiting(&self) -> usize {
        self.shared.waiting()
    }

    /// `GET /metrics` requests answered so far (a reader that has seen `n` and then
    /// `n + 2` has had one whole reading in between).
    pub fn metrics_read(&self) -> usize {
        self.shared
            .metrics_read
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Wait until `in_flight() >= n`.
    pub async fn wait_in_flight(&self, n: usize) {
        self.shared.wait_in_flight(n).await;
    }

    /// While closed, /v1/completions requests are received and counted but wait before
    /// answering.
    pub fn close_gate(&self) {
        self.shared.set_gate(false);
    }

    pub fn open_gate(&self) {
        self.shared.set_gate(true);
    }

    /// Stop the server: the port is closed and open connections are dropped.
    pub async fn shutdown(self) {
        if let Some(handle) = self.task.stop() {
            // The task was aborted; its JoinError (cancelled) is expected.
            let _ = handle.await;
        }
    }
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions::handle))
        .route("/v1/models", get(endpoints::models))
        .route("/tokenize", post(endpoints::tokenize))
        .route("/health", get(endpoints::health))
        .route("/ping", get(endpoints::health).post(endpoints::health))
        .route("/version", get(endpoints::version))
        .route("/metrics", get(endpoints::metrics))
        .fallback(endpoints::not_found)
        .method_not_allowed_fallback(endpoints::method_not_allowed)
        .with_state(shared)
}

/// The [`axum::serve::Listener`] over a shared [`ListenerControl`].
pub(crate) struct RefusableListener(pub Arc<Shared>);

impl axum::serve::Listener for RefusableListener {
    type Io = KillableStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (KillableStream, SocketAddr) {
        loop {
            match poll_fn(|cx| self.0.listener.poll_accept(cx)).await {
                Ok(accepted) => return accepted,
                Err(e) => {
                    // E.g. out of file descriptors: back off instead of spinning.
                    tracing::warn!(error = %e, "mock-vllm accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.0.listener.addr())
    }
}
