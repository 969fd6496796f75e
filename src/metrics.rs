//! Prometheus metrics: the registry, its typed handles and `GET /metrics` (text format
//! 0.0.4, no key needed; an ops route, not in the OpenAPI document).
//!
//! Labels come only from bounded sets: configured model ids (`""` when the request named
//! no known model), configured GPU labels, status codes, error codes and fixed outcome
//! and reason words. Never a key, a key prefix, a client-chosen string or request text.
//!
//! Per-upstream series are labelled `{model, gpu}` ([`UpstreamLabels`]) and created for
//! every configured upstream at start-up (and for each one a reload adds), so per-node
//! gauges (health, …) can be added alongside with the same labels.

use rustc_hash::FxHashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::fleet::{Decision, Fleet};
use crate::store::JobStatus;

/// The content type of [`Metrics::encode`]'s text.
pub const PROMETHEUS_CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// `{model, status, code}` of a finished request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    model: String,
    status: u16,
    code: String,
}

/// `{model}`: a configured model id, or `""`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

/// `{model, gpu}`: one configured upstream of one model.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    model: String,
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    model: String,
    gpu: String,
    outcome: &'static str,
}

/// `{model, outcome}` of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoutingLabels {
    model: String,
    outcome: &'static str,
}

/// The outcomes of prefix routing, in the order of [`routing_index`].
const ROUTING_OUTCOMES: [&str; 4] = ["owner", "runner_up", "fallback_load", "no_owner"];

/// Where a decision is counted among [`ROUTING_OUTCOMES`]; `None` for `routing = "load"`.
fn routing_index(decision: Decision) -> Option<usize> {
    match decision {
        Decision::Load => None,
        Decision::Owner => Some(0),
        Decision::RunnerUp => Some(1),
        Decision::FallbackLoad => Some(2),
        Decision::NoOwner => Some(3),
    }
}

/// `{code}`: an error code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// How a request forwarded to an upstream went. The order indexes each upstream's
/// cached counters (`UpstreamSeries::outcomes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamOutcome {
    /// A success status.
    Ok,
    /// The upstream answered with an error status.
    ErrorStatus,
    /// No answer: connection refused or reset, or the node was found dead.
    Unreachable,
    /// A non-streaming request overran the request window.
    Deadline,
}

impl UpstreamOutcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::ErrorStatus => "error_status",
            Self::Unreachable => "unreachable",
            Self::Deadline => "deadline",
        }
    }
}

/// Why a client connection was refused or closed before it sent a whole request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectionRefusal {
    /// `connections.max_open` connections were open already.
    MaxOpen,
    /// `connections.max_open_per_client` connections from its address were open already.
    MaxOpenPerClient,
    /// No complete request head within `connections.header_read_timeout_ms` (a slow
    /// client, or an idle keep-alive connection).
    HeaderTimeout,
    /// A request head hyper could not parse (answered 400).
    MalformedHead,
    /// A request head over the limits of `connections` (answered 431).
    HeadTooLarge,
    /// A TLS handshake that failed (HTTPS only): not TLS, nothing in common, or the
    /// client refused the certificate. (One not done in time is a `HeaderTimeout`.)
    TlsHandshake,
}

impl ConnectionRefusal {
    const ALL: [Self; 6] = [
        Self::MaxOpen,
        Self::MaxOpenPerClient,
        Self::HeaderTimeout,
        Self::MalformedHead,
        Self::HeadTooLarge,
        Self::TlsHandshake,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::MaxOpen => "max_open",
            Self::MaxOpenPerClient => "max_open_per_client",
            Self::HeaderTimeout => "header_timeout",
            Self::MalformedHead => "malformed_head",
            Self::HeadTooLarge => "head_too_large",
            Self::TlsHandshake => "tls_handshake",
        }
    }
}

/// Why admission refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    RateLimited,
    QueueFull,
    BudgetExceeded,
    Unavailable,
}

impl Refusal {
    fn as_str(self) -> &'static str {
        match self {
            Self::RateLimited => "rate_limited",
            Self::QueueFull => "queue_full",
            Self::BudgetExceeded => "budget_exceeded",
            Self::Unavailable => "unavailable",
        }
    }
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// The registry and the handles of every series; cheap to clone.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

struct Inner {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_duration: HistogramFamily<ModelLabels>,
    queue_wait: HistogramFamily<ModelLabels>,
    prompt_tokens: Family<ModelLabels, Counter>,
    completion_tokens: Family<ModelLabels, Counter>,
    upstream_ttfb: HistogramFamily<UpstreamLabels>,
    upstream_requests: Family<OutcomeLabels, Counter>,
    in_flight: Family<UpstreamLabels, Gauge>,
    upstream_duration: HistogramFamily<UpstreamLabels>,
    upstream_up: Family<UpstreamLabels, Gauge>,
    upstream_ejections: Family<UpstreamLabels, Counter>,
    /// Each upstream's series, resolved once (see [`UpstreamMetrics`]): model → GPU label.
    upstreams: RwLock<FxHashMap<String, FxHashMap<String, UpstreamMetrics>>>,
    /// Each model's request series, resolved once; `""` for requests of no known model.
    models: RwLock<FxHashMap<String, Arc<ModelSeries>>>,
    prefix_cache_hit_rate: Family<UpstreamLabels, Gauge<f64, AtomicU64>>,
    hold_limit: Family<UpstreamLabels, Gauge>,
    /// Each model's routing counters, resolved at start-up: no label is built per request.
    routing: FxHashMap<String, [Counter; 4]>,
    fleet_queued: Family<ModelLabels, Gauge>,
    admission_running: Gauge,
    admission_queued: Gauge,
    admission_refusals: Family<ReasonLabels, Counter>,
    open_connections: Gauge,
    idle_connections: Gauge,
    connection_refusals: Family<ReasonLabels, Counter>,
    ledger_pending: Gauge,
    ledger_lost: Gauge,
    jobs: Family<StatusLabels, Gauge>,
    job_runs: Family<OutcomeWord, Counter>,
    jobs_running: Gauge,
    harvest_waiting: Gauge,
    harvest_declined: Counter,
    unauthenticated_refusals: Family<CodeLabels, Counter>,
}

/// `{status}` of a job.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: &'static str,
}

/// The outcomes of a job's run (see `fleetgate_job_runs`).
pub const JOB_RUN_OUTCOMES: [&str; 6] = [
    "succeeded",
    "failed",
    "cancelled",
    "retried",
    "requeued",
    "lost",
];

/// `{outcome}` of a job's run.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeWord {
    outcome: &'static str,
}

/// 5 ms to ~5.5 min, doubling: whole requests (long generations included).
fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 17))
}

/// 1 ms to ~65 s, doubling: time to the upstream's first byte.
fn ttfb_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl Metrics {
    /// Registers every series; the per-upstream ones start at zero for each configured
    /// upstream.
    pub fn new(fleet: &Fleet) -> Self {
        let mut registry = Registry::with_prefix("fleetgate");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Finished API requests (/v1, /admin), by configured model (\"\" when none), HTTP status and error code (\"\" on success)",
            requests.clone(),
        );
        let request_duration: HistogramFamily<ModelLabels> =
            Family::new_with_constructor(duration_histogram);
        registry.register(
            "request_duration_seconds",
            "Request latency from arrival to the last byte of the response",
            request_duration.clone(),
        );
        let queue_wait: HistogramFamily<ModelLabels> = Family::new_with_constructor(ttfb_histogram);
        registry.register(
            "queue_wait_seconds",
            "Time an admitted request waited for its turn: in its key's queue for a running slot, then in its model's fleet queue for a node with room",
            queue_wait.clone(),
        );
        let prompt_tokens = Family::<ModelLabels, Counter>::default();
        registry.register(
            "prompt_tokens",
            "Prompt tokens charged",
            prompt_tokens.clone(),
        );
        let completion_tokens = Family::<ModelLabels, Counter>::default();
        registry.register(
            "completion_tokens",
            "Completion tokens charged",
            completion_tokens.clone(),
        );
        let upstream_ttfb: HistogramFamily<UpstreamLabels> =
            Family::new_with_constructor(ttfb_histogram);
        registry.register(
            "upstream_time_to_first_byte_seconds",
            "Time from sending a completion to the upstream until the first byte of its successful response body",
            upstream_ttfb.clone(),
        );
        let upstream_requests = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "upstream_requests",
            "Completions forwarded to an upstream, by outcome: ok, error_status (it answered an error status), unreachable (no answer) or deadline (a non-streaming request overran the request window)",
            upstream_requests.clone(),
        );
        let in_flight = Family::<UpstreamLabels, Gauge>::default();
        registry.register(
            "in_flight_requests",
            "Completions forwarded to an upstream whose response body has not ended yet",
            in_flight.clone(),
        );
        let upstream_duration: HistogramFamily<UpstreamLabels> =
            Family::new_with_constructor(duration_histogram);
        registry.register(
            "upstream_duration_seconds",
            "Time from sending a completion to the upstream until the end of its successful response body",
            upstream_duration.clone(),
        );
        let upstream_up = Family::<UpstreamLabels, Gauge>::default();
        registry.register(
            "upstream_up",
            "1 while the node takes requests, 0 while it is ejected (failed requests or probes) or its model sleeps",
            upstream_up.clone(),
        );
        let upstream_ejections = Family::<UpstreamLabels, Counter>::default();
        registry.register(
            "upstream_ejections",
            "Times the node was taken out of rotation after a failed request or probe",
            upstream_ejections.clone(),
        );
        let prefix_cache_hit_rate = Family::<UpstreamLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "upstream_prefix_cache_hit_rate",
            "Share of the prompt tokens the node found in its prefix cache, from its vllm:prefix_cache_hits/queries between its last two readings that saw queries (absent until then)",
            prefix_cache_hit_rate.clone(),
        );
        let hold_limit = Family::<UpstreamLabels, Gauge>::default();
        registry.register(
            "upstream_hold_limit",
            "The limit on this replica's requests in flight to the node learned from the load it reports (fleet.hold = \"auto\", a node without max_in_flight that reported requests waiting); beyond it requests wait in the fleet queue. Absent while none holds",
            hold_limit.clone(),
        );
        let routing_decisions = Family::<RoutingLabels, Counter>::default();
        registry.register(
            "routing_decisions",
            "Requests of models with routing = \"prefix\", by how their node was picked: owner (the node that owns the prompt's prefix), runner_up (the owner was overloaded or full: the node that ranks next for the prefix), fallback_load (both were, for a prefix seen before: the least-loaded pick) or no_owner (a prompt shorter than one block, or a prefix this replica has not seen recently whose owner and runner-up were busier than the lightest node: the least-loaded pick)",
            routing_decisions.clone(),
        );
        let routing = fleet
            .models()
            .iter()
            .map(|model| {
                let counter = |outcome| {
                    routing_decisions
                        .get_or_create(&RoutingLabels {
                            model: model.id.clone(),
                            outcome,
                        })
                        .clone()
                };
                (model.id.clone(), ROUTING_OUTCOMES.map(counter))
            })
            .collect();
        let fleet_queued = Family::<ModelLabels, Gauge>::default();
        registry.register(
            "fleet_queued",
            "Admitted requests waiting for a node of the model below its max_in_flight",
            fleet_queued.clone(),
        );
        let admission_running = Gauge::default();
        registry.register(
            "admission_running",
            "Admitted requests holding a running slot, all keys together; this replica's own requests (with Redis, other replicas count theirs)",
            admission_running.clone(),
        );
        let admission_queued = Gauge::default();
        registry.register(
            "admission_queued",
            "Requests waiting in a key's queue, all keys together; this replica's own requests (with Redis, other replicas count theirs)",
            admission_queued.clone(),
        );
        let admission_refusals = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "admission_refusals",
            "Requests refused by admission: rate_limited, queue_full, budget_exceeded or unavailable (the shared counters cannot be reached)",
            admission_refusals.clone(),
        );

        let open_connections = Gauge::default();
        registry.register(
            "open_connections",
            "Client connections open now (at most connections.max_open)",
            open_connections.clone(),
        );
        let idle_connections = Gauge::default();
        registry.register(
            "idle_connections",
            "HTTP/1 client connections open and waiting for a request, handed back by the protocol library (they hold no buffers)",
            idle_connections.clone(),
        );
        let ledger_pending = Gauge::default();
        registry.register(
            "ledger_pending_rows",
            "Usage rows settled but not yet committed to the ledger (growing: the store is behind or away; at 100,000 new requests get 503 store_unavailable)",
            ledger_pending.clone(),
        );
        let ledger_lost = Gauge::default();
        registry.register(
            "ledger_lost_rows",
            "Usage rows the store refused (invalid, or breaking a constraint) since start; each is logged with its request id",
            ledger_lost.clone(),
        );
        let connection_refusals = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "connection_refusals",
            "Client connections closed without a whole request: max_open (the cap was reached), header_timeout (no complete request head in time, idle keep-alive included), malformed_head (a request head that could not be parsed, answered 400) or head_too_large (a request head over 16 KiB or 100 header lines, answered 431)",
            connection_refusals.clone(),
        );
        let jobs = Family::<StatusLabels, Gauge>::default();
        registry.register(
            "jobs",
            "Completion jobs in the store (all replicas), by status: queued, running, succeeded, failed, expired, cancelled; refreshed by each replica's sweep",
            jobs.clone(),
        );
        for status in JobStatus::ALL {
            let _ = jobs.get_or_create(&StatusLabels {
                status: status.as_str(),
            });
        }
        let job_runs = Family::<OutcomeWord, Counter>::default();
        registry.register(
            "job_runs",
            "Runs of jobs by this replica's workers, by outcome: succeeded, failed, cancelled, retried (never reached a node; queued again with back-off), requeued (cut by shutdown) or lost (its lease lapsed and another worker took the job)",
            job_runs.clone(),
        );
        for outcome in JOB_RUN_OUTCOMES {
            let _ = job_runs.get_or_create(&OutcomeWord { outcome });
        }
        let jobs_running = Gauge::default();
        registry.register(
            "jobs_running",
            "Jobs this replica's workers are running now (at most jobs.workers)",
            jobs_running.clone(),
        );
        let harvest_waiting = Gauge::default();
        registry.register(
            "harvest_waiting",
            "Long-polls (GET /v1/harvest/{id}?wait=) waiting on this replica",
            harvest_waiting.clone(),
        );
        let harvest_declined = Counter::default();
        registry.register(
            "harvest_declined",
            "Long-polls answered at once with X-Acs-Longpoll: declined because jobs.max_waiters (or the per-key bound) were waiting",
            harvest_declined.clone(),
        );
        let unauthenticated_refusals = Family::<CodeLabels, Counter>::default();
        registry.register(
            "unauthenticated_refusals",
            "API requests refused (4xx) before a key or the admin token was shown, by error code: invalid_api_key (no key, a malformed, unknown or revoked one), not_found, …; only a sample of them, one a second, is logged and recorded in the request log",
            unauthenticated_refusals.clone(),
        );
        let _ = unauthenticated_refusals.get_or_create(&CodeLabels {
            code: "invalid_api_key".to_owned(),
        });
        for reason in ConnectionRefusal::ALL {
            let _ = connection_refusals.get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            });
        }

        let metrics = Self(Arc::new(Inner {
            registry,
            requests,
            request_duration,
            queue_wait,
            prompt_tokens,
            completion_tokens,
            upstream_ttfb,
            upstream_requests,
            in_flight,
            upstream_duration,
            upstream_up,
            upstream_ejections,
            upstreams: RwLock::default(),
            models: RwLock::default(),
            prefix_cache_hit_rate,
            hold_limit,
            routing,
            fleet_queued,
            admission_running,
            admission_queued,
            admission_refusals,
            open_connections,
            idle_connections,
            connection_refusals,
            ledger_pending,
            ledger_lost,
            jobs,
            job_runs,
            jobs_running,
            harvest_waiting,
            harvest_declined,
            unauthenticated_refusals,
        }));
        for model in fleet.models() {
            for upstream in model.nodes().iter() {
                metrics.node_added(&model.id, &upstream.gpu);
            }
        }
        metrics
    }

    /// Starts the series of a node of `model` at zero (at start-up, or when a reload
    /// adds it).
    pub fn node_added(&self, model: &str, gpu: &str) {
        let labels = UpstreamLabels::new(model, gpu);
        let _ = self.0.in_flight.get_or_create(&labels);
        let _ = self.0.upstream_ejections.get_or_create(&labels);
    }

    /// Drops the gauges of a node a reload removed (its counters and histograms stay:
    /// what it did is still true). A request still on it counts on a gauge no longer
    /// exported.
    pub fn node_removed(&self, model: &str, gpu: &str) {
        if let Some(gpus) = write(&self.0.upstreams).get_mut(model) {
            gpus.remove(gpu);
        }
        let labels = UpstreamLabels::new(model, gpu);
        self.0.in_flight.remove(&labels);
        self.0.upstream_up.remove(&labels);
        self.0.prefix_cache_hit_rate.remove(&labels);
        self.0.hold_limit.remove(&labels);
    }

    /// Reads the fleet's state into its gauges (node health, prefix-cache hit rates,
    /// learned limits, queue depths); called at
    /// each scrape, so the gauges are never stale.
    pub fn observe_fleet(&self, fleet: &Fleet) {
        for model in fleet.models() {
            self.0
                .fleet_queued
                .get_or_create(&ModelLabels {
                    model: model.id.clone(),
                })
                .set(i64::from(model.queued()));
            for upstream in model.nodes().iter() {
                let up = model.takes_requests(upstream);
                let labels = UpstreamLabels::new(&model.id, &upstream.gpu);
                self.0.upstream_up.get_or_create(&labels).set(i64::from(up));
                if let Some(rate) = upstream.reported.prefix_cache_hit_rate() {
                    self.0
                        .prefix_cache_hit_rate
                        .get_or_create(&labels)
                        .set(rate);
                }
                match upstream.hold_limit() {
                    Some(limit) => {
                        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
                        self.0.hold_limit.get_or_create(&labels).set(limit);
                    }
                    None => {
                        self.0.hold_limit.remove(&labels);
                    }
                }
            }
        }
    }

    /// The registry in the Prometheus text format.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_text::encode(&mut text, &self.0.registry)?;
        Ok(text)
    }

    /// One finished request (its metadata row is final). `model`: the configured model
    /// id, `None` when the request named no known model.
    pub fn request_finished(&self, finished: &FinishedRequest<'_>) {
        let model = finished.model.unwrap_or("");
        let series = cached(
            &self.0.models,
            |models| models.get(model),
            |models| {
                models.entry(model.to_owned()).or_insert_with(|| {
                    let labels = ModelLabels {
                        model: model.to_owned(),
                    };
                    Arc::new(ModelSeries {
                        duration: self.0.request_duration.get_or_create_owned(&labels),
                        queue_wait: OnceLock::new(),
                        prompt_tokens: OnceLock::new(),
                        completion_tokens: OnceLock::new(),
                        labels,
                    })
                })
            },
        );
        self.0
            .requests
            .get_or_create(&RequestLabels {
                model: series.labels.model.clone(),
                status: finished.status,
                code: finished.error_code.unwrap_or("").to_owned(),
            })
            .inc();
        series.duration.observe(finished.latency.as_secs_f64());
        if let Some(waited) = finished.queue_wait {
            series
                .queue_wait
                .get_or_init(|| self.0.queue_wait.get_or_create_owned(&series.labels))
                .observe(waited.as_secs_f64());
        }
        let tokens = [
            (
                &series.prompt_tokens,
                &self.0.prompt_tokens,
                finished.prompt_tokens,
            ),
            (
                &series.completion_tokens,
                &self.0.completion_tokens,
                finished.completion_tokens,
            ),
        ];
        for (counter, family, tokens) in tokens {
            if let Some(tokens) = tokens {
                counter
                    .get_or_init(|| family.get_or_create_owned(&series.labels))
                    .inc_by(tokens);
            }
        }
    }

    /// The handles of one upstream of one model.
    pub fn upstream(&self, model: &str, gpu: &str) -> UpstreamMetrics {
        cached(
            &self.0.upstreams,
            |upstreams| upstreams.get(model)?.get(gpu),
            |upstreams| {
                upstreams
                    .entry(model.to_owned())
                    .or_default()
                    .entry(gpu.to_owned())
                    .or_insert_with(|| UpstreamMetrics::resolve(&self.0, model, gpu))
            },
        )
    }

    /// How the node of one request of `model` was picked.
    pub fn routed(&self, model: &str, decision: Decision) {
        if let (Some(counters), Some(index)) = (self.0.routing.get(model), routing_index(decision))
        {
            counters[index].inc();
        }
    }

    /// Counts a request as running (holding an admission slot) while the guard lives.
    pub fn admission_running(&self) -> GaugeGuard {
        GaugeGuard::new(self.0.admission_running.clone())
    }

    /// Counts a request as queued while the guard lives.
    pub fn admission_queued(&self) -> GaugeGuard {
        GaugeGuard::new(self.0.admission_queued.clone())
    }

    /// Reads the usage ledger writer's counts into their gauges; called at each scrape.
    pub fn observe_ledger(&self, pending: u64, lost: u64) {
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.0.ledger_pending.set(gauge(pending));
        self.0.ledger_lost.set(gauge(lost));
    }

    /// The store's job counts by status (statuses with no job read 0).
    pub fn observe_jobs(&self, counts: &[(JobStatus, u64)]) {
        for status in JobStatus::ALL {
            let n = counts.iter().find(|(s, _)| *s == status).map_or(0, |c| c.1);
            self.0
                .jobs
                .get_or_create(&StatusLabels {
                    status: status.as_str(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Counts a job's run that ended with `outcome`, one of [`JOB_RUN_OUTCOMES`].
    pub fn job_run(&self, outcome: &'static str) {
        self.0
            .job_runs
            .get_or_create(&OutcomeWord { outcome })
            .inc();
    }

    /// Counts a job as running on this replica while the guard lives.
    pub fn job_running(&self) -> GaugeGuard {
        GaugeGuard::new(self.0.jobs_running.clone())
    }

    /// Counts a long-poll as waiting while the guard lives.
    pub fn harvest_waiting(&self) -> GaugeGuard {
        GaugeGuard::new(self.0.harvest_waiting.clone())
    }

    pub fn harvest_declined(&self) {
        self.0.harvest_declined.inc();
    }

    /// Counts a client connection as open while the guard lives.
    pub fn connection_open(&self) -> GaugeGuard {
        GaugeGuard::new(self.0.open_connections.clone())
    }

    /// Counts a connection as idle (see `connections/client.rs`) while the guard lives.
    pub fn connection_idle(&self) -> GaugeGuard {
        GaugeGuard::new(self.0.idle_connections.clone())
    }

    pub fn connection_refused(&self, reason: ConnectionRefusal) {
        self.0
            .connection_refusals
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc();
    }

    /// An API request refused before anybody was authenticated, with its error code.
    pub fn unauthenticated_refusal(&self, code: Option<&str>) {
        self.0
            .unauthenticated_refusals
            .get_or_create(&CodeLabels {
                code: code.unwrap_or("").to_owned(),
            })
            .inc();
    }

    pub fn admission_refused(&self, reason: Refusal) {
        self.0
            .admission_refusals
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc();
    }
}

/// What [`Metrics::request_finished`] records, from the request's metadata row.
pub struct FinishedRequest<'a> {
    pub model: Option<&'a str>,
    pub status: u16,
    pub error_code: Option<&'a str>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub latency: Duration,
    /// How long it waited for its turn, when it was admitted.
    pub queue_wait: Option<Duration>,
}

impl UpstreamLabels {
    fn new(model: &str, gpu: &str) -> Self {
        Self {
            model: model.to_owned(),
            gpu: gpu.to_owned(),
        }
    }
}

/// The request series of one model (see [`UpstreamMetrics`] for why they are kept).
struct ModelSeries {
    labels: ModelLabels,
    duration: Histogram,
    /// Resolved when a request of the model first waited (or was admitted at once).
    queue_wait: OnceLock<Histogram>,
    prompt_tokens: OnceLock<Counter>,
    completion_tokens: OnceLock<Counter>,
}

/// The series of one upstream of one model, each found in its family once: a request
/// updates four of them, and finding one (hashing its labels, under the family's lock)
/// cost more than the update. Resolved when first used, so that a series appears in
/// `/metrics` only once it has something to say, as it would without the cache.
#[derive(Clone)]
pub struct UpstreamMetrics(Arc<UpstreamSeries>);

struct UpstreamSeries {
    labels: UpstreamLabels,
    in_flight: Gauge,
    ttfb: OnceLock<Histogram>,
    duration: OnceLock<Histogram>,
    /// By [`UpstreamOutcome`], in its order.
    outcomes: [OnceLock<Counter>; 4],
    /// The families, to resolve the rest from (not a [`Metrics`] handle: the series are
    /// kept inside it, and holding one would make a cycle that is never freed).
    ttfb_family: HistogramFamily<UpstreamLabels>,
    duration_family: HistogramFamily<UpstreamLabels>,
    requests_family: Family<OutcomeLabels, Counter>,
    ejections_family: Family<UpstreamLabels, Counter>,
}

impl UpstreamMetrics {
    fn resolve(inner: &Inner, model: &str, gpu: &str) -> Self {
        let labels = UpstreamLabels::new(model, gpu);
        Self(Arc::new(UpstreamSeries {
            in_flight: inner.in_flight.get_or_create_owned(&labels),
            labels,
            ttfb: OnceLock::new(),
            duration: OnceLock::new(),
            outcomes: Default::default(),
            ttfb_family: inner.upstream_ttfb.clone(),
            duration_family: inner.upstream_duration.clone(),
            requests_family: inner.upstream_requests.clone(),
            ejections_family: inner.upstream_ejections.clone(),
        }))
    }

    /// Counts a request as in flight to this upstream while the guard lives.
    pub fn in_flight(&self) -> GaugeGuard {
        GaugeGuard::new(self.0.in_flight.clone())
    }

    pub fn outcome(&self, outcome: UpstreamOutcome) {
        let series = &self.0;
        series.outcomes[outcome as usize]
            .get_or_init(|| {
                series.requests_family.get_or_create_owned(&OutcomeLabels {
                    model: series.labels.model.clone(),
                    gpu: series.labels.gpu.clone(),
                    outcome: outcome.as_str(),
                })
            })
            .inc();
    }

    /// The first body byte arrived; `sent`: when the request was sent.
    pub fn first_byte(&self, sent: Instant) {
        let series = &self.0;
        series
            .ttfb
            .get_or_init(|| series.ttfb_family.get_or_create_owned(&series.labels))
            .observe(sent.elapsed().as_secs_f64());
    }

    /// The successful response body ended; `sent`: when the request was sent.
    pub fn finished(&self, sent: Instant) {
        let series = &self.0;
        series
            .duration
            .get_or_init(|| series.duration_family.get_or_create_owned(&series.labels))
            .observe(sent.elapsed().as_secs_f64());
    }

    /// The node was taken out of rotation.
    pub fn ejected(&self) {
        self.0.ejections_family.get_or_create(&self.0.labels).inc();
    }
}

/// Increments a gauge now and decrements it when dropped.
#[derive(Debug)]
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    fn new(gauge: Gauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The entry `find` finds under the read lock, or else the one `insert` makes (or finds,
/// if another thread made it meanwhile) under the write lock.
fn cached<M, V: Clone>(
    lock: &RwLock<M>,
    find: impl FnOnce(&M) -> Option<&V>,
    insert: impl FnOnce(&mut M) -> &mut V,
) -> V {
    if let Some(found) = find(&read(lock)) {
        return found.clone();
    }
    insert(&mut write(lock)).clone()
}

/// The lock's map even if a thread panicked holding it: the map stays whole.
fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}
