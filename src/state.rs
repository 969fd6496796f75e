//! The application state every handler shares: configuration, store, limiter, fleet,
//! the vLLM client, metrics and the background work tied to shutdown. It knows no route
//! (see `router.rs`).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::Limiter;
use crate::admission::give_back::GiveBack;
use crate::admission::renewals::Renewals;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::https_certificate::ServedCertificate;
use crate::job_hub::JobHub;
use crate::keys::KeyTable;
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::request_log::RequestLog;
use crate::store::Store;
use crate::upstream::UpstreamClient;

#[derive(Clone)]
pub struct AppState(Arc<Inner>);

struct Inner {
    config: Config,
    /// Live per-key counters: rate, slots, queue, budget reservations.
    limiter: Arc<dyn Limiter>,
    /// Gives back admissions a shared limiter may have applied unseen.
    give_back: Option<GiveBack>,
    /// Keeps the leases of running requests alive (shared limiters only).
    renewals: Option<Renewals>,
    /// Cancelled when the shutdown grace period is over: bodies still streaming end.
    draining: CancellationToken,
    /// The request metadata log's writer.
    request_log: RequestLog,
    /// The usage ledger's write-behind writer.
    ledger: Ledger,
    /// Work that must finish even when its request is gone (settling, leaving a queue);
    /// waited for on shutdown.
    tasks: TaskTracker,
    /// Keys, the usage ledger, the request log: SQLite or PostgreSQL.
    store: Arc<dyn Store>,
    /// Every key in memory, following the store's change feed.
    keys: Arc<KeyTable>,
    /// Models and their nodes.
    fleet: Arc<Fleet>,
    /// The pooled HTTP client for all upstreams.
    upstream: UpstreamClient,
    /// The Prometheus registry and its handles (`GET /metrics`).
    metrics: Metrics,
    /// Held by a reload of the config file (`reload.rs`): one at a time.
    reloading: tokio::sync::Mutex<()>,
    /// Completion jobs' long-polls and the runs on this replica.
    jobs: JobHub,
    /// The certificate `listen` serves, with `[tls]`; a reload reads its files again.
    certificate: Option<Arc<ServedCertificate>>,
}

impl AppState {
    pub fn new(
        config: Config,
        store: Arc<dyn Store>,
        keys: Arc<KeyTable>,
        ledger: Ledger,
        limiter: Arc<dyn Limiter>,
        certificate: Option<ServedCertificate>,
    ) -> anyhow::Result<Self> {
        let upstream = UpstreamClient::new(&config.upstream)?;
        let fleet = Arc::new(Fleet::new(&config));
        let metrics = Metrics::new(&fleet);
        let jobs = JobHub::new(&config.jobs);
        Ok(Self(Arc::new(Inner {
            config,
            give_back: GiveBack::start(Arc::clone(&limiter)),
            renewals: Renewals::start(Arc::clone(&limiter)),
            limiter,
            draining: CancellationToken::new(),
            request_log: RequestLog::start(Arc::clone(&store)),
            ledger,
            tasks: TaskTracker::new(),
            store,
            keys,
            fleet,
            upstream,
            metrics,
            reloading: tokio::sync::Mutex::new(()),
            jobs,
            certificate: certificate.map(Arc::new),
        })))
    }

    pub fn config(&self) -> &Config {
        &self.0.config
    }
    pub fn store(&self) -> &dyn Store {
        self.0.store.as_ref()
    }
    /// The keys requests authenticate against.
    pub fn keys(&self) -> &Arc<KeyTable> {
        &self.0.keys
    }
    pub fn fleet(&self) -> &Fleet {
        &self.0.fleet
    }
    pub fn upstream(&self) -> &UpstreamClient {
        &self.0.upstream
    }
    pub fn limiter(&self) -> &dyn Limiter {
        self.0.limiter.as_ref()
    }
    /// Where a refused admission goes to be given back (shared limiters only).
    pub fn give_back(&self) -> Option<&GiveBack> {
        self.0.give_back.as_ref()
    }
    /// Where a running request's lease is kept alive (shared limiters only).
    pub fn renewals(&self) -> Option<&Renewals> {
        self.0.renewals.as_ref()
    }
    /// An owned handle on the limiter, for work that outlives the request.
    pub fn limiter_handle(&self) -> Arc<dyn Limiter> {
        Arc::clone(&self.0.limiter)
    }
    pub fn tasks(&self) -> &TaskTracker {
        &self.0.tasks
    }
    pub fn draining(&self) -> &CancellationToken {
        &self.0.draining
    }
    pub fn request_log(&self) -> &RequestLog {
        &self.0.request_log
    }
    pub fn ledger(&self) -> &Ledger {
        &self.0.ledger
    }
    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }
    pub fn jobs(&self) -> &JobHub {
        &self.0.jobs
    }
    /// The certificate `listen` serves over HTTPS; `None` without `[tls]` (plain HTTP).
    pub fn certificate(&self) -> Option<&Arc<ServedCertificate>> {
        self.0.certificate.as_ref()
    }
    pub fn reloading(&self) -> &tokio::sync::Mutex<()> {
        &self.0.reloading
    }
}
