//! The path of one completion once its body is read: check → plan → admit → dispatch →
//! relay, to an [`Outcome`]. The `/v1/completions` handler runs it for a synchronous
//! call and renders the outcome; a job's worker (`crate::jobs`) runs it for a job, with
//! a window of its own and charged under the job's id, and keeps the outcome.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::admit::{self, Gate};
use super::budget_refusal::{self, OnBudgetClamp};
use super::cold;
use super::cut::unless_draining;
use super::dispatch::{self, Unanswered, Window};
use super::outcome::{Answer, Clamp, Completed, Failed, Outcome, Tags};
use super::outgoing::Outgoing;
use super::plan::{DeadlineFit, Plan, PlanError, Planner};
use super::request::CompletionRequest;
use super::settle::{JobRun, Settlement};
use crate::admission::{Cost, KeyLimits};
use crate::contract::{MAX_OUTPUT_WORK, Workload};
use crate::error::ApiError;
use crate::fleet::{Model, NoNode, Node};
use crate::request_record::RequestRecord;
use crate::state::AppState;
use crate::store::KeyRecord;
use crate::upstream::Served;

/// How a completion runs: a synchronous call, or a run of a job.
#[derive(Debug, Clone, Copy)]
pub struct Mode<'a> {
    /// How long a non-streaming request may take upstream (`None`: no limit).
    pub window: Option<Duration>,
    /// The job this is a run of: its usage is recorded under the job's id (so that a job
    /// is charged once, for the run that ends it; see [`JobRun`]), and it does not count
    /// against the key's rate (the submission did).
    pub job: Option<&'a JobRun>,
    /// Whether a budget clamp runs or is refused (`X-Acs-Budget-Clamp`).
    pub on_budget_clamp: OnBudgetClamp,
    /// What the request is for, as declared (`X-Acs-Workload`): interactive traffic
    /// keeps a model that scales to zero warm.
    pub workload: Option<Workload>,
}

impl Mode<'_> {
    /// A client waits: the request window applies, the usage is the request's own.
    pub fn synchronous(
        state: &AppState,
        on_budget_clamp: OnBudgetClamp,
        workload: Option<Workload>,
    ) -> Self {
        Self {
            window: Some(Duration::from_millis(
                state.config().fleet.request_window_ms,
            )),
            job: None,
            on_budget_clamp,
            workload,
        }
    }
}

/// A valid request and the model it names (`'b`: the body, `'s`: the state).
pub struct Checked<'b, 's> {
    pub request: CompletionRequest<'b>,
    pub model: &'s Model,
}

impl<'b, 's> Checked<'b, 's> {
    /// Parses the body and checks it against its model; the model goes into `record`
    /// (also for a refused request that names a known one).
    pub fn parse(
        state: &'s AppState,
        bytes: &'b [u8],
        record: &RequestRecord,
    ) -> Result<Self, ApiError> {
        let request = CompletionRequest::parse(bytes).inspect_err(|_| {
            // Count a refused request under its model when it names a known one (unknown
            // names are not metric labels: any string could be sent).
            if let Some(model) =
                named_model(bytes).and_then(|id| state.fleet().resolve(Some(&id)).ok())
            {
                record.set_model(&model.id);
            }
        })?;
        let model = state.fleet().resolve(request.model())?;
        record.set_model(&model.id);
        request.check_logprobs_cap(model.max_logprobs)?;
        Ok(Self { request, model })
    }
}

/// Runs a completion whose body has been read and checked, for the key `key`; the
/// outcome names the upstream's model and GPU.
pub async fn complete(
    state: &AppState,
    key: &KeyRecord,
    request_id: &str,
    record: RequestRecord,
    checked: Checked<'_, '_>,
    mode: Mode<'_>,
) -> Outcome {
    let Checked { request, model } = checked;
    if state.config().traces.enabled() {
        // For the trace only (see `http::every_request`).
        tracing::Span::current().record("model", model.id.as_str());
    }
    model
        .sleep
        .touch(mode.workload == Some(Workload::Interactive));

    let facts = Facts::learn(state, model).await.map_err(Failed::unsent)?;
    // The node asked for the model's facts stands in when no node is named for the
    // request, unless it failed for a reason of the gateway's own (limits, budget,
    // admission, store): then nothing went upstream.
    let asked = facts.node.clone();
    let served = Some(Arc::clone(&facts.served));
    let mut outcome =
        match prepare(state, key, request_id, record, &request, model, facts, mode).await {
            Ok(prepared) => send(state, model, &request, prepared, request_id).await,
            Err(error) => Err(Failed::unsent(error)),
        };
    let (tags, node_failed) = match &mut outcome {
        Ok(completed) => (&mut completed.tags, true),
        Err(failed) => (&mut failed.tags, failed.error.from_upstream()),
    };
    tags.served = served;
    if tags.node.is_none() && node_failed {
        tags.node = asked;
    }
    outcome
}

/// The `model` a body names, if it is a JSON object with a string `model`, whatever
/// else in it is wrong.
fn named_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<String>,
    }
    serde_json::from_slice::<Named>(body).ok()?.model
}

/// What a model serves, and a node that is up to count tokens with (none while the
/// model boots).
struct Facts {
    node: Option<Arc<Node>>,
    served: Arc<Served>,
}

impl Facts {
    /// Asks a node that is up (any node of the model can say what it serves and count
    /// tokens; the node that runs the request is picked once it is admitted). When none
    /// is up and the model has a wake hook: if its checkpoint is known from before,
    /// planning goes on without a node (the wake follows admission); if not, the model
    /// is woken and the request waits for the boot here, before anything is sent to
    /// the client.
    async fn learn(state: &AppState, model: &Model) -> Result<Self, ApiError> {
        if let Some(facts) = Self::ask_nodes(state, model).await? {
            return Ok(facts);
        }
        if !model.sleep.can_wake() {
            return Err(NoNode::NoneUp.into_error(&model.id));
        }
        // Known from before: plan and admit first, and wake only a request that may run
        // (`forward`), so a refused request never boots a GPU.
        if let Some(served) = model.served() {
            return Ok(Self { node: None, served });
        }
        Self::after_boot(state, model).await
    }

    /// Wakes the model (or joins its boot), waits for a node to come up — nothing has
    /// been sent to the client yet — then asks it.
    async fn after_boot(state: &AppState, model: &Model) -> Result<Self, ApiError> {
        unless_draining(state, async {
            model.wake(state.upstream()).await?;
            cold::wait_booted(model).await
        })
        .await?;
        Self::ask_nodes(state, model)
            .await?
            .ok_or_else(|| NoNode::NoneUp.into_error(&model.id))
    }

    /// `Ok(None)` when no node is up; a node that fails to answer is ejected and the
    /// next one asked.
    async fn ask_nodes(state: &AppState, model: &Model) -> Result<Option<Self>, ApiError> {
        let mut last_error = None;
        for _ in 0..model.node_count() {
            let Some(node) = model.any_up() else { break };
            match node.discover(state.upstream()).await {
                Ok(served) => {
                    return Ok(Some(Self {
                        node: Some(node),
                        served,
                    }));
                }
                Err(err) => {
                    dispatch::eject(state, model, &node);
                    last_error = Some(err);
                }
            }
        }
        match last_error {
            Some(err) if !model.sleep.can_wake() => Err(err.into()),
            _ => Ok(None),
        }
    }
}

/// Plans the request (its `max_tokens`, the prompt tokens it may cost), with the tokens
/// counted by `facts`' node; `facts` follows the node that counted. A count that needs
/// a node while none is up waits for the model's boot, or, unless `may_wake`, fails
/// with `upstream_unavailable`.
async fn plan(
    state: &AppState,
    request: &CompletionRequest<'_>,
    model: &Model,
    facts: &mut Facts,
    window: Option<Duration>,
    may_wake: bool,
    gate: Gate<'_>,
) -> Result<Plan, ApiError> {
    // Each node found dead while counting tokens is replaced once by another.
    let mut attempts = model.node_count() + 1;
    async {
        loop {
            let planner = Planner {
                client: state.upstream(),
                upstream: facts.node.as_deref(),
                served: &facts.served,
                deadline: window.map(|w| DeadlineFit::new(w, model.decode_tokens_per_second)),
                gate: Some(gate),
            };
            let lost = facts.node.as_ref().map(|node| node.lost());
            let planned = tokio::select! {
                planned = planner.plan(request) => planned,
                () = cancelled(lost.as_ref()) => Err(PlanError::NodeLost),
            };
            match planned {
                Ok(plan) => return Ok(plan),
                Err(PlanError::Refused(err)) => return Err(err),
                // Counting needs the booting model's tokenizer: nothing has been sent to
                // the client yet, so wait for the boot here.
                Err(PlanError::NoNodeToCount) if !may_wake => {
                    return Err(NoNode::NoneUp.into_error(&model.id));
                }
                Err(PlanError::NoNodeToCount) => *facts = Facts::after_boot(state, model).await?,
                Err(PlanError::NodeLost) if attempts > 1 => {
                    attempts -= 1;
                    *facts = Facts::learn(state, model).await?;
                }
                Err(PlanError::NodeLost) => return Err(dispatch::stopped_answering()),
            }
        }
    }
    .instrument(tracing::debug_span!("plan"))
    .await
}

/// The store has been away long enough that usage waiting to be recorded reached its
/// bound: refuse rather than run requests whose usage could not be kept.
fn unless_backlogged(state: &AppState) -> Result<(), ApiError> {
    if state.ledger().backlogged() {
        return Err(ApiError::StoreUnavailable);
    }
    Ok(())
}

/// Whether the request would be admitted now, as [`complete`] would admit it, without
/// running it (a job's submission): plan, then take and at once give back a running
/// slot. Counts one start against the key's rate.
pub async fn admissible(
    state: &AppState,
    key: &KeyRecord,
    request_id: &str,
    checked: &Checked<'_, '_>,
    window: Option<Duration>,
) -> Result<(), ApiError> {
    let Checked { request, model } = checked;
    let limits = KeyLimits::resolve(&state.config().limits, &key.limits);
    let gate = Gate {
        state,
        key: key.id,
        limits: &limits,
    };
    // Never a boot for a submission: with no node up, the checks that need one (the
    // prompt's exact tokens, the context) wait for the run; admission takes the worst
    // case.
    let facts = match Facts::ask_nodes(state, model).await? {
        Some(facts) => Some(facts),
        None => model.served().map(|served| Facts { node: None, served }),
    };
    let cost = match facts {
        Some(mut facts) => match plan(state, request, model, &mut facts, window, false, gate).await
        {
            Ok(plan) => plan.cost,
            Err(err) if facts.node.is_none() && err.from_upstream() => worst_case(request),
            Err(err) => return Err(err),
        },
        None => worst_case(request),
    };
    unless_backlogged(state)?;
    admit::check(state, key.id, &limits, &cost, request_id)
        .instrument(tracing::debug_span!("admit"))
        .await
}

/// What a request may cost at most, known without a node: its prompts' upper bounds
/// and its `max_tokens` (the most any request may generate when it names none).
fn worst_case(request: &CompletionRequest<'_>) -> Cost {
    Cost {
        prompt_tokens: request.prompt().token_upper_bounds().iter().sum(),
        fan_out: request.prompt_count().saturating_mul(request.n()),
        max_tokens: request.max_tokens().unwrap_or(MAX_OUTPUT_WORK),
    }
}

/// An admitted request, planned, its body for the node made.
struct Prepared {
    settlement: Settlement,
    body: Bytes,
    window: Option<Duration>,
    clamp: Option<Clamp>,
}

/// plan → admit: everything decided before a node is asked.
#[expect(
    clippy::too_many_arguments,
    reason = "the request's parts as `complete` has them; a struct for one call would only rename them"
)]
async fn prepare(
    state: &AppState,
    key: &KeyRecord,
    request_id: &str,
    record: RequestRecord,
    request: &CompletionRequest<'_>,
    model: &Model,
    mut facts: Facts,
    mode: Mode<'_>,
) -> Result<Prepared, ApiError> {
    let window = if request.stream() { None } else { mode.window };
    let mut limits = KeyLimits::resolve(&state.config().limits, &key.limits);
    if mode.job.is_some() {
        limits = limits.without_rate();
    }
    let gate = Gate {
        state,
        key: key.id,
        limits: &limits,
    };
    let plan = plan(state, request, model, &mut facts, window, true, gate).await?;
    unless_backlogged(state)?;
    let asked = std::time::Instant::now();
    let grant = admit::admit(state, key.id, &limits, &plan.cost, request_id)
        .instrument(tracing::debug_span!("admit"))
        .await?;
    record.add_queue_wait(asked.elapsed());
    let mut settlement = Settlement::new(
        state.clone(),
        key.id,
        limits.share,
        request_id.to_owned(),
        grant,
        &plan.cost,
        echoed_prompts(request, &plan),
        record,
    );
    if let Some(job) = mode.job {
        settlement.charge_as(job.clone());
    }
    let applied = settlement.grant().max_tokens;
    let budget_clamped = applied < plan.cost.max_tokens;
    if budget_clamped && mode.on_budget_clamp == OnBudgetClamp::Refuse {
        let grant = settlement.grant().clone();
        settlement.release_unused().await;
        return Err(budget_refusal::refusal(state, key.id, &limits, &plan.cost, &grant).await);
    }
    let send_max_tokens = (budget_clamped || plan.default_max_tokens).then_some(applied);
    Ok(Prepared {
        body: Bytes::from(request.upstream_body(&facts.served.name, send_max_tokens)),
        clamp: clamp(&plan, applied, budget_clamped),
        settlement,
        window,
    })
}

/// The prompt tokens a request's choices repeat before what they generate: each of
/// the `n` choices of each prompt echoes its prompt.
fn echoed_prompts(request: &CompletionRequest<'_>, plan: &Plan) -> u64 {
    if request.echo() {
        request.n().saturating_mul(plan.cost.prompt_tokens)
    } else {
        0
    }
}

/// dispatch → relay; for a sleeping model, wake it and commit the answer while it
/// boots.
async fn send(
    state: &AppState,
    model: &Model,
    request: &CompletionRequest<'_>,
    prepared: Prepared,
    request_id: &str,
) -> Outcome {
    let Prepared {
        settlement,
        body,
        window,
        clamp,
    } = prepared;
    let affinity = model.affinity(request.prompt().start());
    if model.sleep.can_wake() && !model.is_up() {
        // Wake it (or join the boot under way), then commit a 200 and keep the client
        // company while it boots.
        if let Err(err) = unless_draining(state, model.wake(state.upstream())).await {
            settlement.release_unused().await;
            return Err(Failed::unsent(err));
        }
        let pending = cold::Pending {
            state: state.clone(),
            model_id: model.id.clone(),
            body,
            affinity,
            include_usage: request.include_usage(),
            stream: request.stream(),
            window: Window(window),
        };
        return Ok(Completed {
            answer: Answer::Booting(cold::respond(pending, settlement, request_id.to_owned())),
            tags: Tags {
                clamp,
                ..Tags::default()
            },
        });
    }
    let outgoing = Outgoing {
        state,
        model,
        include_usage: request.include_usage(),
        body,
        affinity,
        window: Window(window),
    };
    match outgoing.send(settlement).await {
        Ok((relayed, node)) => Ok(Completed {
            answer: Answer::Relayed(relayed),
            tags: Tags {
                node: Some(node),
                clamp,
                ..Tags::default()
            },
        }),
        Err(Unanswered {
            error,
            upstream,
            sent,
        }) => Err(Failed {
            error,
            sent,
            tags: Tags {
                node: upstream,
                clamp,
                ..Tags::default()
            },
        }),
    }
}

/// Resolves when `token` is cancelled; never without one.
async fn cancelled(token: Option<&CancellationToken>) {
    match token {
        Some(token) => token.cancelled().await,
        None => std::future::pending().await,
    }
}

/// How the request window or the budget cut `max_tokens`, if either did.
fn clamp(plan: &Plan, applied: u64, budget_clamped: bool) -> Option<Clamp> {
    (plan.deadline_clamped || budget_clamped).then_some(Clamp {
        requested: plan.requested_max_tokens,
        applied,
        deadline: plan.deadline_clamped,
        budget: budget_clamped,
        default: plan.default_max_tokens,
    })
}
