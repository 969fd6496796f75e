//! Running the gateway: logging, store, state, listener, reloads on SIGHUP, graceful
//! shutdown.

use std::future::Future;
use std::net::SocketAddr;

use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tracing::Level;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::admission::ledger::LedgerUsage;
use crate::admission::local::LocalLimiter;
use crate::admission::redis::RedisLimiter;
use crate::admission::redis::journal::{self, JournalStore};
use crate::admission::unlimited::Unlimited;
use crate::admission::{Limiter, UsageSource};

use crate::background::job_workers::Workers;
use crate::background::prober::Prober;
use crate::background::{checkpoint_sweeper, job_upkeep, request_log_retention, service_exchange};
use crate::config::{Config, LogFormat, TraceSettings};
use crate::http::router::build_router;
use crate::keys::KeyTable;
use crate::ledger::Ledger;
use crate::state::AppState;
use crate::traces::Exporter;

/// Keeps the log writer's thread and the trace exporter alive; dropping it exports the
/// spans still queued, then writes out the log lines still queued. Hold it until the
/// process is done logging.
#[must_use = "dropping the guard stops the log writer and the trace exporter"]
pub struct LogGuard {
    traces: Option<Exporter>,
    _writer: crate::log_writer::LogWriterGuard,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        // Before the log writer goes, so that a failed export is still logged.
        if let Some(traces) = self.traces.take() {
            traces.shutdown();
        }
    }
}

/// Installs the global tracing subscriber (stderr; stdout belongs to CLI output) and,
/// when `[traces]` names an endpoint, the trace exporter.
/// `RUST_LOG` refines the log filter; the default logs requests at info.
///
/// Lines are written to stderr by a thread of their own, so a request never waits for
/// the write (under load a line per request was a quarter of the gateway's time), nor
/// wakes that thread (see `log_writer`). No line is lost.
///
/// Each output has its own filter: the request path's stage spans are at debug level,
/// which the log leaves out by default, and only the traces layer (when there is one)
/// takes them, so with traces off they cost nothing.
pub fn init_logging(format: LogFormat, traces: &TraceSettings) -> anyhow::Result<LogGuard> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (writer, guard) = crate::log_writer::stderr().context("starting the log writer")?;
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(writer);
    let fmt = match format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Text => fmt
            .fmt_fields(crate::wire::log_line::LineFields)
            .event_format(crate::wire::log_line::LineFormat::default())
            .boxed(),
    };
    let logs = tracing_subscriber::registry().with(fmt.with_filter(filter));
    let exporter = Exporter::start(traces).context("starting the trace exporter")?;
    // A second initialisation (tests, demo after serve) keeps the first subscriber.
    let _ = match &exporter {
        Some(exporter) => {
            // The exporter's own warnings (a failed export, dropped spans) go to the
            // log only: a span of the exporter's work would be exported in turn.
            let spans = Targets::new()
                .with_default(Level::INFO)
                .with_target("fleetgate", Level::DEBUG)
                .with_target("opentelemetry", LevelFilter::OFF);
            logs.with(exporter.layer().with_filter(spans)).try_init()
        }
        None => logs.try_init(),
    };
    Ok(LogGuard {
        traces: exporter,
        _writer: guard,
    })
}

/// Opens the store named by the config, sets up the live counters (Redis when
/// configured, else in process) and builds the application state.
pub async fn prepare(config: Config) -> anyhow::Result<AppState> {
    let store = crate::store::connect(&config.database_url).await?;
    let writer = Ledger::start(Arc::clone(&store));
    let ledger: Arc<dyn UsageSource> = Arc::new(LedgerUsage {
        store: Arc::clone(&store),
        writer: writer.clone(),
    });
    let limiter: Arc<dyn Limiter> = match &config.redis_url {
        _ if !config.limits.enabled => Arc::new(Unlimited::new(ledger)),
        // Connects lazily: the gateway starts while Redis is down and refuses requests
        // (503 admission_unavailable) until it is back.
        Some(url) => {
            let redis = Arc::new(RedisLimiter::connect(
                url,
                &config.redis_key_prefix,
                ledger,
            )?);
            redis.refuse_cluster().await?;
            let weak: Weak<dyn JournalStore> = Arc::downgrade(&redis) as Weak<RedisLimiter>;
            writer.report_commits_to(journal::forget(weak.clone()));
            // Ends when the limiter is dropped (the task holds it weakly).
            tokio::spawn(journal::tend(weak, writer.clone()));
            redis
        }
        None => Arc::new(LocalLimiter::new(ledger)),
    };
    let keys = KeyTable::load(Arc::clone(&store))
        .await
        .context("reading the API keys")?;
    AppState::new(config, store, keys, writer, limiter)
}

/// Binds a listener on `address`. A failure (most often the port is taken, by another
/// gateway or an earlier run still stopping) names the address and where to pick
/// another: `setting`, the flag or config key that chose it.
pub async fn bind(address: SocketAddr, setting: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}; pick another address with {setting}"))
}

/// After the grace period, how long the cut connections get to close.
const DRAIN_CUT_WAIT: Duration = Duration::from_secs(2);
/// After the server has stopped, how long the last settlements get to finish.
const SETTLE_WAIT: Duration = Duration::from_secs(10);

/// Serves on `listener` until `shutdown` resolves, then lets in-flight requests finish.
pub async fn serve(
    state: AppState,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // Dropped at the end, after the last settlement: requests' tasks run on the lanes.
    let lanes = crate::http::connections::Lanes::start(state.config().connections.threads)
        .context("cannot start the connection threads")?;
    // Before anything slow: from here on, SIGHUP reloads instead of ending the process.
    let reloads = crate::reload::on_hangup(state.clone()).map(tokio::spawn);
    let probes = Prober::of(&state);
    probes.discover().await;
    let prober = tokio::spawn(probes.clone().run());
    let held = tokio::spawn(probes.clone().watch_held());
    let keep_warm = tokio::spawn(probes.keep_warm());
    let sweeper = tokio::spawn(checkpoint_sweeper::run(state.clone()));
    let retention = tokio::spawn(request_log_retention::run(state.clone()));
    let exchange = tokio::spawn(service_exchange::run(state.clone()));
    let stop_following = tokio_util::sync::CancellationToken::new();
    let keys = tokio::spawn(Arc::clone(state.keys()).follow(stop_following.clone()));
    let grace = Duration::from_millis(state.config().shutdown_grace_ms);
    let tasks = state.tasks().clone();
    let draining = state.draining().clone();
    let request_log = state.request_log().clone();
    let ledger = state.ledger().clone();
    // The listeners beside the API's: ops (scrapes and probes) and admin.
    let stop_beside = tokio_util::sync::CancellationToken::new();
    let mut beside = Vec::new();
    if let Some(address) = state.config().ops_listen {
        let router = crate::http::router::build_ops_router(state.clone());
        beside.push(serve_beside(&state, "ops", address, router, stop_beside.clone()).await?);
    }
    if let Some(address) = state.config().admin_listen {
        let router = crate::http::router::build_admin_router(state.clone());
        beside.push(serve_beside(&state, "admin", address, router, stop_beside.clone()).await?);
    }
    let connections = state.config().connections.clone();
    let metrics = state.metrics().clone();
    let workers = Workers::start(state.clone());
    let cut_jobs = workers.cutter();
    let jobs_hub = state.jobs().clone();
    let stop_upkeep = tokio_util::sync::CancellationToken::new();
    let sweep = tokio::spawn(job_upkeep::sweep(state.clone(), stop_upkeep.clone()));
    let watch = tokio::spawn(job_upkeep::watch(state.clone(), stop_upkeep.clone()));
    let router = build_router(state);
    let stopping = Arc::new(Notify::new());
    // Cancelled when the shutdown starts: workers stop claiming, long-polls answer.
    let stop_jobs = jobs_hub.stopping().clone();
    let stop_accepting = {
        let stopping = Arc::clone(&stopping);
        let stop_jobs = stop_jobs.clone();
        async move {
            shutdown.await;
            stopping.notify_one();
            stop_jobs.cancel();
        }
    };
    // Job runs get the same grace as requests, then are cut and queued again.
    let jobs_stopped = async {
        stop_jobs.cancelled().await;
        workers.shutdown(grace).await;
    };
    let server = crate::http::connections::serve(
        listener,
        router,
        &connections,
        connections.max_open,
        &lanes,
        metrics,
        stop_accepting,
    );
    // Once asked to stop: no new connections; in-flight requests get `grace` to finish.
    // Then the rest are cut: their bodies end (an error, so no client mistakes a cut
    // answer for a whole one) and their settlements run below like any other.
    let requests_stopped = async {
        tokio::pin!(server);
        tokio::select! {
            () = &mut server => {}
            () = async {
                stopping.notified().await;
                tokio::time::sleep(grace).await;
            } => {
                tracing::warn!(grace_ms = grace.as_millis() as u64, "in-flight requests did not finish within the shutdown grace period; cutting them");
                // Job runs first: cut by their workers they are queued again.
                cut_jobs.cut().await;
                draining.cancel();
                // Cut connections close at once; requests still waiting in a queue hold
                // nothing worth waiting for.
                let _ = tokio::time::timeout(DRAIN_CUT_WAIT, &mut server).await;
            }
        }
        // Also when the server ended by itself.
        stop_jobs.cancel();
    };
    tokio::join!(requests_stopped, jobs_stopped);
    stop_upkeep.cancel();
    let _ = tokio::join!(sweep, watch);
    prober.abort();
    held.abort();
    keep_warm.abort();
    sweeper.abort();
    retention.abort();
    exchange.abort();
    if let Some(reloads) = reloads {
        reloads.abort();
    }
    stop_following.cancel();
    let _ = keys.await;
    // Their connections close as the API's do; one that will not is cut.
    stop_beside.cancel();
    for mut listener in beside {
        if tokio::time::timeout(DRAIN_CUT_WAIT, &mut listener)
            .await
            .is_err()
        {
            listener.abort();
        }
    }
    // Settlements of the last requests (ledger rows, released slots); bounded, so that
    // nothing can keep the process from exiting.
    tasks.close();
    if tokio::time::timeout(SETTLE_WAIT, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            wait_ms = SETTLE_WAIT.as_millis() as u64,
            "some request tasks did not finish after shutdown; exiting anyway"
        );
    }
    let usage = ledger.close(SETTLE_WAIT).await;
    tracing::info!(
        written = usage.written,
        unwritten = usage.pending,
        lost = usage.lost,
        "usage ledger closed"
    );
    let stats = request_log.close().await;
    tracing::info!(
        written = stats.written,
        dropped = stats.dropped,
        "request log closed"
    );
    drop(lanes);
    Ok(())
}

/// Serves `router` on a listener beside the API's (`what`: "ops", `ops_listen`, for
/// `/metrics`, `/health`, `/ready` and `/live`; "admin", `admin_listen`, for the admin
/// API) until `stop` is cancelled: with the API listener's time-outs, and a cap of its
/// own (`connections.ops_max_open`), so that connections held open there cannot take
/// the file descriptors the API's need, nor the other way round.
async fn serve_beside(
    state: &AppState,
    what: &'static str,
    address: SocketAddr,
    router: axum::Router,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = bind(address, &format!("`{what}_listen` in the config")).await?;
    let address = listener.local_addr()?;
    match what {
        "admin" => tracing::info!(%address, "fleetgate admin listening"),
        _ => tracing::info!(%address, "fleetgate ops listening"),
    }
    let settings = state.config().connections.clone();
    let metrics = state.metrics().clone();
    // Scrapes, probes and admin calls are few and answered at once: the shared runtime
    // serves them, not the connection threads.
    let lanes = crate::http::connections::Lanes::start(0)
        .with_context(|| format!("cannot start the {what} listener"))?;
    Ok(tokio::spawn(async move {
        crate::http::connections::serve(
            listener,
            router,
            &settings,
            settings.ops_max_open,
            &lanes,
            metrics,
            stop.cancelled_owned(),
        )
        .await;
    }))
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down");
}
