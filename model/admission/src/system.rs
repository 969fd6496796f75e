//! The protocol as a whole, as a stateright model: gateway replicas (each with its
//! requests, its ledger writer and its journal heartbeat), one Redis running the
//! scripts ([`crate::scripts`]) for one API key, the store holding the usage ledger, and
//! the faults. Every script call is one step (a script runs atomically); what the
//! gateway does between calls — the seeding's ledger read and its `SET NX`, handing a
//! row to the writer, the writer's commit and its report to the journal — is a step of
//! its own, so the checker interleaves them every way the replicas could.
//!
//! What the gateway does, as `src/` does it:
//! - `admit` (`Limiter::admit`); on `SEED`, read the ledger's month sum, `SET NX` it, and
//!   admit again; on `QUEUED`, `turn` until started or refused; a waiting client may
//!   `leave`;
//! - a running request renews its lease whenever it likes (the renewals task; any may
//!   be late: a Redis or a replica that stood still);
//! - a request ends by telling the client its usage (at most its reservation: only the
//!   prompt, or all of it), handing the row to the ledger writer, then `finish`ing
//!   with the journal; a finish not confirmed is retried until it is;
//! - a call whose reply is lost (Redis ran it unseen) refuses the request, which is
//!   then given back: `leave`, and `finish` with nothing used;
//! - the writer commits its rows (idempotent on the request id) when the store is up,
//!   and reports them to the journal (`HDEL`; the report may be lost: the sweep offers
//!   the journal's rows to the writer again); a replica adopts the journal of a writer
//!   whose heartbeat lapsed.
//!
//! Faults: a replica crashes (losing its requests and its writer's rows) and restarts
//! as a new writer; Redis loses its data; the store is down; a reply is lost; time
//! passes with nobody renewing (a stall), by a second or by more than a lapsed slot is
//! kept; a whole slot set expires while no script runs.

use std::collections::{BTreeMap, BTreeSet};

use stateright::{Model, Property};

use crate::properties;
use crate::scripts::{Cost, LAPSED_KEEP_US, Lease, Limits, Redis, Reply, Ttls, Writer};

/// One second of Redis's clock, in µs.
pub const SECOND: u64 = 1_000_000;

/// A request, on the replica that serves it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    pub replica: u8,
    pub cost: Cost,
}

/// How many faults of each kind a run may have, and how far time may go (the set-up);
/// or how many it has had (the state).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Faults {
    pub crashes: u8,
    pub redis_losses: u8,
    pub lost_replies: u8,
    pub store_outages: u8,
    /// Seconds of time passing while the replicas make no step.
    pub ticks: u8,
    /// Jumps of time past [`LAPSED_KEEP_US`].
    pub jumps: u8,
    /// Whole slot sets expiring under a stall.
    pub set_expiries: u8,
    /// Reads of the key's usage (`usage.lua`) from outside its requests.
    pub looks: u8,
}

/// A deliberately broken script, to show that the checker catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// `finish.lua` forgets to release the slot (`ZREM run lease`).
    FinishKeepsSlot,
}

/// The model: the set-up the checker explores.
#[derive(Clone, Debug)]
pub struct System {
    pub replicas: u8,
    pub requests: Vec<Request>,
    pub limits: Limits,
    pub ttls: Ttls,
    pub faults: Faults,
    pub mutation: Option<Mutation>,
    /// The properties without their documented exceptions: the checker then shows a
    /// run that needs each exception (that the bounds are not slack).
    pub strict: bool,
}

/// Where a request is, as its replica sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Not yet sent.
    New,
    /// `SEED` answered: the counter is missing. `queued`: the request's queue arrival,
    /// when it was waiting (it calls `turn` again after seeding, else `admit`).
    NeedSeed { queued: Option<u8> },
    /// The ledger read: `value` tokens, the sum of the rows it had (`rows`).
    Seeding {
        queued: Option<u8>,
        value: u64,
        rows: BTreeSet<Lease>,
    },
    /// Waiting in the key's queue; `arrival` orders the waiters.
    Queued { arrival: u8 },
    /// Forwarded, holding a slot and `hold` reserved tokens.
    Running { hold: u64 },
    /// The client was told it used `told`; the row is with the writer; `finish` not yet
    /// confirmed.
    Settling { told: u64 },
    /// Settled.
    Done { told: u64 },
    /// Refused after a call whose reply was lost: to be given back.
    GiveBack,
    /// Refused (rate, queue full, budget, queue place gone) or gave up waiting.
    Refused,
    /// Its replica died before the client was told anything.
    Dead,
    /// Its replica died after telling the client `told`, before `finish` was confirmed.
    DeadTold { told: u64 },
}

impl Phase {
    /// Whether the request is over, as far as its client is concerned.
    pub fn is_over(&self) -> bool {
        matches!(
            self,
            Phase::Done { .. } | Phase::Refused | Phase::Dead | Phase::DeadTold { .. }
        )
    }

    /// What the client was told it used.
    pub fn told(&self) -> Option<u64> {
        match self {
            Phase::Settling { told } | Phase::Done { told } | Phase::DeadTold { told } => {
                Some(*told)
            }
            _ => None,
        }
    }
}

/// A gateway replica.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Replica {
    pub up: bool,
    /// Its ledger writer (a new one at each start).
    pub writer: Writer,
    /// Rows handed to the writer, not yet committed: request → tokens.
    pub buffer: BTreeMap<Lease, u64>,
}

/// Bookkeeping that no component keeps, for the properties (ghost state).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// The requests whose tokens the live counter holds, and how many times: by the
    /// seeding (the ledger's rows then) and by `finish`.
    pub counted: BTreeMap<Lease, u8>,
    /// Running requests whose slot lapsed while they ran (a stall longer than the
    /// lease): they may run beside requests that took their slot.
    pub overdue: BTreeSet<Lease>,
    /// Requests whose usage the live counter may never see: their reservation
    /// vanished while they were in flight (Redis lost its data, or it lapsed and was
    /// dropped after [`LAPSED_KEEP_US`]); their row was not yet in the ledger when Redis
    /// lost its data (the seeding that follows may miss it); or their replica died
    /// after telling the client, before its `finish` reached Redis.
    pub unseen: BTreeSet<Lease>,
    /// Rows lost with the replica that held them: never committed, and not journaled
    /// where a survivor could adopt them.
    pub lost_rows: BTreeSet<Lease>,
    /// Requests whose `finish` Redis ran (answered or not).
    pub finished: BTreeSet<Lease>,
    /// A waiter was passed over: a request started while an earlier arrival still
    /// waited with its place alive.
    pub out_of_order: bool,
    pub arrivals: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// Redis's clock (µs).
    pub now: u64,
    pub redis: Redis,
    /// The usage ledger: request → tokens.
    pub store: BTreeMap<Lease, u64>,
    pub store_up: bool,
    pub replicas: Vec<Replica>,
    pub phases: Vec<Phase>,
    /// The faults this run has had so far.
    pub spent: Faults,
    pub ghost: Ghost,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Admit(Lease),
    /// Redis ran `admit` but its reply was lost.
    AdmitUnanswered(Lease),
    ReadLedger(Lease),
    SetSeed(Lease),
    Turn(Lease),
    /// Redis ran `turn` but its reply was lost.
    TurnUnanswered(Lease),
    Leave(Lease),
    Renew(Lease),
    /// The request ends: the client is told it used this many tokens.
    Respond(Lease, u64),
    Finish(Lease),
    /// Redis ran `finish` but its reply was lost (retried later).
    FinishUnanswered(Lease),
    GiveBack(Lease),
    /// The writer commits its rows and reports them to the journal.
    Commit(u8),
    /// The writer commits its rows; the report to the journal is lost.
    CommitUnreported(u8),
    /// The writer offers its journal's rows to the ledger again.
    Sweep(u8),
    Adopt(u8, Writer),
    /// The replica's heartbeat, when it is missing.
    Beat(u8),
    AliveLapses(Writer),
    /// `usage.lua`, from whoever asks.
    Look,
    Crash(u8),
    Restart(u8),
    RedisLoss,
    StoreDown,
    StoreUp,
    Tick,
    Jump,
    RunSetExpires,
}

impl System {
    /// The writer id of `replica`'s `start`-th start.
    fn writer(&self, replica: u8, start: u8) -> Writer {
        replica + self.replicas * start
    }

    fn cost(&self, lease: Lease) -> Cost {
        self.requests[usize::from(lease)].cost
    }

    fn replica_of(&self, lease: Lease) -> usize {
        usize::from(self.requests[usize::from(lease)].replica)
    }

    fn leases(&self) -> impl Iterator<Item = Lease> + use<> {
        0..self.requests.len() as u8
    }

    /// The actions that move the system on without a fault, in the order a fault-free
    /// continuation tries them ([`properties::quiesce`]).
    pub fn progress(&self, state: &State, actions: &mut Vec<Action>) {
        // Journals are adopted by the first replica up (any would do: adopt.lua is
        // atomic, so two adopting at once is two orders of the same steps).
        let adopter = (0..self.replicas).find(|&r| state.replicas[usize::from(r)].up);
        for r in 0..self.replicas {
            let replica = &state.replicas[usize::from(r)];
            if !replica.up {
                actions.push(Action::Restart(r));
                continue;
            }
            if !state.redis.journal.alive.contains(&replica.writer) {
                actions.push(Action::Beat(r));
            }
            if state.store_up && !replica.buffer.is_empty() {
                actions.push(Action::Commit(r));
            }
            let own = state.redis.journal.rows.get(&replica.writer);
            if own.is_some_and(|rows| rows.keys().any(|l| !replica.buffer.contains_key(l))) {
                actions.push(Action::Sweep(r));
            }
            if adopter == Some(r) {
                for &w in &state.redis.journal.writers {
                    if w != replica.writer && !state.redis.journal.alive.contains(&w) {
                        actions.push(Action::Adopt(r, w));
                    }
                }
            }
        }
        for &w in &state.redis.journal.alive {
            if !self.lives(state, w) {
                actions.push(Action::AliveLapses(w));
            }
        }
        if !state.store_up {
            actions.push(Action::StoreUp);
        }
        for lease in self.leases() {
            if !state.replicas[self.replica_of(lease)].up {
                continue;
            }
            match &state.phases[usize::from(lease)] {
                Phase::New => actions.push(Action::Admit(lease)),
                Phase::NeedSeed { .. } if state.store_up => {
                    actions.push(Action::ReadLedger(lease));
                }
                Phase::Seeding { .. } => actions.push(Action::SetSeed(lease)),
                Phase::Queued { .. } => actions.push(Action::Turn(lease)),
                Phase::Running { hold } => {
                    actions.push(Action::Respond(lease, *hold));
                    actions.push(Action::Renew(lease));
                }
                Phase::Settling { .. } => actions.push(Action::Finish(lease)),
                Phase::GiveBack => actions.push(Action::GiveBack(lease)),
                _ => {}
            }
        }
    }

    /// Whether writer `w` belongs to a replica running now.
    fn lives(&self, state: &State, w: Writer) -> bool {
        let replica = &state.replicas[usize::from(w % self.replicas)];
        replica.up && replica.writer == w
    }

    /// The faults still allowed in `state`, and what a client may do besides carrying
    /// on (leave the queue, have its answer cut short) and a renewal arriving late.
    fn faults(&self, state: &State, actions: &mut Vec<Action>) {
        let (spent, allowed) = (&state.spent, &self.faults);
        for lease in self.leases() {
            if !state.replicas[self.replica_of(lease)].up {
                continue;
            }
            let phase = &state.phases[usize::from(lease)];
            match phase {
                // Cut short: only the prompt was used.
                Phase::Running { hold } if *hold != self.cost(lease).prompt => {
                    actions.push(Action::Respond(lease, self.cost(lease).prompt));
                }
                Phase::Queued { .. } => actions.push(Action::Leave(lease)),
                // A renewal sent before the request ended, arriving after its finish
                // (each runtime has a connection of its own).
                Phase::Settling { .. } | Phase::Done { .. } => {
                    actions.push(Action::Renew(lease));
                }
                _ => {}
            }
            if spent.lost_replies < allowed.lost_replies {
                match phase {
                    Phase::New => actions.push(Action::AdmitUnanswered(lease)),
                    Phase::Queued { .. } => actions.push(Action::TurnUnanswered(lease)),
                    Phase::Settling { .. } => actions.push(Action::FinishUnanswered(lease)),
                    _ => {}
                }
            }
        }
        for r in 0..self.replicas {
            let replica = &state.replicas[usize::from(r)];
            if !replica.up {
                continue;
            }
            // A replica holding nothing crashes to no effect but a new writer id.
            let holds = !replica.buffer.is_empty()
                || state.redis.journal.rows.contains_key(&replica.writer)
                || self.leases().any(|l| {
                    self.replica_of(l) == usize::from(r) && !state.phases[usize::from(l)].is_over()
                });
            if holds && spent.crashes < allowed.crashes {
                actions.push(Action::Crash(r));
            }
            if spent.lost_replies < allowed.lost_replies {
                if state.store_up && !replica.buffer.is_empty() {
                    actions.push(Action::CommitUnreported(r));
                }
                // A live replica's heartbeats lost for longer than they live (a
                // stall): its journal may be adopted while it still writes.
                if state.redis.journal.alive.contains(&replica.writer) {
                    actions.push(Action::AliveLapses(replica.writer));
                }
            }
        }
        // Anyone may read the key's usage at any moment (`/v1/usage`, the Workbench):
        // `usage.lua` purges and may recount, as `peek.lua` and `occupancy.lua` purge.
        if spent.looks < allowed.looks {
            actions.push(Action::Look);
        }
        if spent.redis_losses < allowed.redis_losses {
            actions.push(Action::RedisLoss);
        }
        if state.store_up && spent.store_outages < allowed.store_outages {
            actions.push(Action::StoreDown);
        }
        if spent.ticks < allowed.ticks {
            actions.push(Action::Tick);
        }
        if spent.jumps < allowed.jumps {
            actions.push(Action::Jump);
        }
        if spent.set_expiries < allowed.set_expiries
            && state
                .redis
                .key
                .run
                .values()
                .max()
                .is_some_and(|&last| last + SECOND <= state.now)
        {
            actions.push(Action::RunSetExpires);
        }
    }

    /// A script step for `lease`'s request: admit or turn, with the reply handled as the
    /// gateway handles it.
    fn start(&self, state: &mut State, lease: Lease, turn: bool) {
        let i = usize::from(lease);
        let cost = self.cost(lease);
        let waiting_before = waiting_places(state);
        let reply = if turn {
            state
                .redis
                .key
                .turn(lease, &self.limits, &cost, state.now, &self.ttls)
        } else {
            state
                .redis
                .key
                .admit(lease, &self.limits, &cost, state.now, &self.ttls)
        };
        let queued = match state.phases[i] {
            Phase::Queued { arrival } => Some(arrival),
            _ => None,
        };
        state.phases[i] = match reply {
            Reply::Running { hold, .. } => {
                // Started while someone who came earlier still waits with a live place.
                let mine = queued.unwrap_or(u8::MAX);
                if waiting_before
                    .iter()
                    .any(|&(other, arrival)| other != lease && arrival < mine)
                {
                    state.ghost.out_of_order = true;
                }
                Phase::Running { hold }
            }
            Reply::Queued => {
                state.ghost.arrivals += 1;
                Phase::Queued {
                    arrival: state.ghost.arrivals,
                }
            }
            Reply::Seed => Phase::NeedSeed { queued },
            Reply::Wait => state.phases[i].clone(),
            _ => Phase::Refused,
        };
    }

    /// `finish` for `lease`, with the mutation if any.
    fn finish(&self, state: &mut State, lease: Lease, used: u64, writer: Option<Writer>) {
        let slot = state.redis.key.run.get(&lease).copied();
        let before = state.redis.key.used;
        state.redis.finish(lease, used, writer, state.now);
        state.ghost.finished.insert(lease);
        if let (Some(Mutation::FinishKeepsSlot), Some(until)) = (self.mutation, slot) {
            state.redis.key.run.insert(lease, until);
        }
        if before.is_some() && state.redis.key.used != before {
            *state.ghost.counted.entry(lease).or_default() += 1;
        }
    }

    /// After every step: the ghost sets that follow from the state.
    fn observe(&self, state: &mut State) {
        for lease in self.leases() {
            let key = &state.redis.key;
            if let Phase::Running { .. } = state.phases[usize::from(lease)] {
                if !key.run.contains_key(&lease) {
                    state.ghost.overdue.insert(lease);
                }
            } else {
                state.ghost.overdue.remove(&lease);
            }
            let in_flight = match state.phases[usize::from(lease)] {
                Phase::Running { .. } => true,
                Phase::Settling { .. } => !state.ghost.finished.contains(&lease),
                _ => false,
            };
            if in_flight && !key.grants.contains_key(&lease) && !key.lapsed.contains_key(&lease) {
                state.ghost.unseen.insert(lease);
            }
        }
    }
}

/// The queue places alive now, with their requests' arrivals (in the gateway's eyes).
fn waiting_places(state: &State) -> Vec<(Lease, u8)> {
    state
        .phases
        .iter()
        .enumerate()
        .filter_map(|(i, phase)| match phase {
            Phase::Queued { arrival } => {
                let lease = i as Lease;
                let alive = state
                    .redis
                    .key
                    .qexp
                    .get(&lease)
                    .is_some_and(|&until| until > state.now);
                alive.then_some((lease, *arrival))
            }
            _ => None,
        })
        .collect()
}

impl Model for System {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        // The month's counter is seeded (at 0) and every replica's heartbeat is there.
        let mut redis = Redis::default();
        redis.key.seed(0);
        for r in 0..self.replicas {
            redis.beat(self.writer(r, 0));
        }
        vec![State {
            now: 1_000 * SECOND,
            redis,
            store: BTreeMap::new(),
            store_up: true,
            replicas: (0..self.replicas)
                .map(|r| Replica {
                    up: true,
                    writer: self.writer(r, 0),
                    buffer: BTreeMap::new(),
                })
                .collect(),
            phases: vec![Phase::New; self.requests.len()],
            spent: Faults::default(),
            ghost: Ghost::default(),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        self.progress(state, actions);
        self.faults(state, actions);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Admit(lease) => self.start(&mut s, lease, false),
            Action::Turn(lease) => self.start(&mut s, lease, true),
            Action::AdmitUnanswered(lease) | Action::TurnUnanswered(lease) => {
                let turn = matches!(action, Action::TurnUnanswered(_));
                self.start(&mut s, lease, turn);
                s.spent.lost_replies += 1;
                s.phases[usize::from(lease)] = Phase::GiveBack;
            }
            Action::ReadLedger(lease) => {
                let Phase::NeedSeed { queued } = s.phases[usize::from(lease)] else {
                    return None;
                };
                s.phases[usize::from(lease)] = Phase::Seeding {
                    queued,
                    value: s.store.values().sum(),
                    rows: s.store.keys().copied().collect(),
                };
            }
            Action::SetSeed(lease) => {
                let Phase::Seeding {
                    queued,
                    value,
                    rows,
                } = s.phases[usize::from(lease)].clone()
                else {
                    return None;
                };
                if s.redis.key.used.is_none() {
                    s.redis.key.seed(value);
                    s.ghost.counted = rows.into_iter().map(|l| (l, 1)).collect();
                }
                s.phases[usize::from(lease)] = match queued {
                    Some(arrival) => Phase::Queued { arrival },
                    None => Phase::New,
                };
            }
            Action::Leave(lease) => {
                s.redis.key.leave(lease, s.now);
                s.phases[usize::from(lease)] = Phase::Refused;
            }
            Action::Renew(lease) => {
                s.redis.key.renew(lease, s.now, &self.ttls);
            }
            Action::Respond(lease, used) => {
                let i = usize::from(lease);
                s.phases[i] = Phase::Settling { told: used };
                s.replicas[self.replica_of(lease)]
                    .buffer
                    .insert(lease, used);
            }
            Action::Finish(lease) | Action::FinishUnanswered(lease) => {
                let Phase::Settling { told } = s.phases[usize::from(lease)] else {
                    return None;
                };
                let writer = s.replicas[self.replica_of(lease)].writer;
                self.finish(&mut s, lease, told, Some(writer));
                if matches!(action, Action::Finish(_)) {
                    s.phases[usize::from(lease)] = Phase::Done { told };
                } else {
                    s.spent.lost_replies += 1;
                }
            }
            Action::GiveBack(lease) => {
                s.redis.key.leave(lease, s.now);
                self.finish(&mut s, lease, 0, None);
                s.phases[usize::from(lease)] = Phase::Refused;
            }
            Action::Commit(r) | Action::CommitUnreported(r) => {
                let replica = &mut s.replicas[usize::from(r)];
                for (lease, tokens) in std::mem::take(&mut replica.buffer) {
                    s.store.entry(lease).or_insert(tokens);
                    if matches!(action, Action::Commit(_)) {
                        s.redis.forget(replica.writer, lease);
                    }
                }
                if matches!(action, Action::CommitUnreported(_)) {
                    s.spent.lost_replies += 1;
                }
            }
            Action::Sweep(r) => {
                let replica = &mut s.replicas[usize::from(r)];
                if let Some(rows) = s.redis.journal.rows.get(&replica.writer) {
                    replica.buffer.extend(rows.iter().map(|(&l, &t)| (l, t)));
                }
            }
            Action::Adopt(r, theirs) => {
                let ours = s.replicas[usize::from(r)].writer;
                let rows = s.redis.adopt(theirs, ours);
                s.replicas[usize::from(r)].buffer.extend(rows);
            }
            Action::Beat(r) => {
                let writer = s.replicas[usize::from(r)].writer;
                s.redis.beat(writer);
            }
            Action::AliveLapses(w) => {
                if self.lives(&s, w) {
                    s.spent.lost_replies += 1;
                }
                s.redis.journal.alive.remove(&w);
            }
            Action::Look => {
                s.spent.looks += 1;
                s.redis.key.usage(s.now);
            }
            Action::Crash(r) => {
                s.spent.crashes += 1;
                let replica = &mut s.replicas[usize::from(r)];
                replica.up = false;
                let journaled = s.redis.journal.rows.get(&replica.writer);
                for (lease, _) in std::mem::take(&mut replica.buffer) {
                    if !s.store.contains_key(&lease)
                        && !journaled.is_some_and(|rows| rows.contains_key(&lease))
                    {
                        s.ghost.lost_rows.insert(lease);
                    }
                }
                for lease in self.leases() {
                    if self.replica_of(lease) != usize::from(r) {
                        continue;
                    }
                    if matches!(s.phases[usize::from(lease)], Phase::Settling { .. })
                        && !s.ghost.finished.contains(&lease)
                    {
                        s.ghost.unseen.insert(lease);
                    }
                    let phase = &mut s.phases[usize::from(lease)];
                    *phase = match phase {
                        Phase::Settling { told } => Phase::DeadTold { told: *told },
                        Phase::Done { .. } | Phase::Refused | Phase::DeadTold { .. } => {
                            continue;
                        }
                        _ => Phase::Dead,
                    };
                }
            }
            Action::Restart(r) => {
                let start = s.spent.crashes;
                let replica = &mut s.replicas[usize::from(r)];
                replica.up = true;
                replica.writer = self.writer(r, start);
                s.redis.beat(replica.writer);
            }
            Action::RedisLoss => {
                s.spent.redis_losses += 1;
                // Rows settled but not yet in the ledger: the seeding that follows may
                // miss them (their tokens were charged to the counter that is gone).
                for replica in &s.replicas {
                    s.ghost.unseen.extend(replica.buffer.keys());
                }
                // A dead writer's journal was the only copy of its rows.
                for (&w, rows) in &s.redis.journal.rows {
                    if !self.lives(&s, w) {
                        s.ghost
                            .lost_rows
                            .extend(rows.keys().filter(|l| !s.store.contains_key(l)));
                    }
                }
                s.redis = Redis::default();
                s.ghost.counted.clear();
                // The live replicas' next heartbeats (every 2 s, within the 10 s a
                // heartbeat lives) say so again.
                for replica in s.replicas.iter().filter(|r| r.up) {
                    s.redis.beat(replica.writer);
                }
            }
            Action::StoreDown => {
                s.spent.store_outages += 1;
                s.store_up = false;
            }
            Action::StoreUp => s.store_up = true,
            Action::Tick => {
                s.spent.ticks += 1;
                s.now += SECOND;
            }
            Action::Jump => {
                s.spent.jumps += 1;
                s.now += LAPSED_KEEP_US + SECOND;
            }
            Action::RunSetExpires => {
                s.spent.set_expiries += 1;
                s.redis.key.run.clear();
            }
        }
        self.observe(&mut s);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all()
    }
}

impl System {
    /// The set-up the docs quote: three replicas, `requests` requests (one a replica in
    /// turn, each prompt 2 and up to 3 generated tokens: 5 reserved) on one key with one
    /// slot, one queue place and a budget of 8 (so budgets clamp and refuse), leases of
    /// 2 s; and at most one fault of each kind, three seconds of stall, one jump past the
    /// lapsed keep and one read of the key's usage from outside its requests.
    pub fn standard(requests: u8) -> Self {
        let replicas = 3;
        Self {
            replicas,
            requests: (0..requests)
                .map(|i| Request {
                    replica: i % replicas,
                    cost: Cost {
                        prompt: 2,
                        fan_out: 1,
                        max_tokens: 3,
                    },
                })
                .collect(),
            limits: Limits {
                rpm: 0,
                max_concurrent: 1,
                max_queued: 1,
                budget: 8,
            },
            ttls: Ttls {
                lease: 2 * SECOND,
                queue: 2 * SECOND,
            },
            faults: Faults {
                crashes: 1,
                redis_losses: 1,
                lost_replies: 1,
                store_outages: 1,
                ticks: 3,
                jumps: 1,
                set_expiries: 1,
                looks: 1,
            },
            mutation: None,
            strict: false,
        }
    }
}
