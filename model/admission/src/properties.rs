//! The properties, stated as `docs/reliability.md` states them. Safety holds in every
//! reachable state; liveness and "nothing lost" are checked from every reachable state
//! by letting the faults stop there ([`quiesce`]): the fault-free continuation must
//! settle everything, free everything and agree with the ledger.

use std::sync::atomic::{AtomicU64, Ordering};

use stateright::Property;

use crate::scripts::{LAPSED_KEEP_US, Lease, Reply};
use crate::system::{Phase, SECOND, State, System};

/// The properties' names, as the checker reports them.
pub const BUDGET: &str =
    "budget: told usage <= budget + the usage of requests whose reservation vanished";
pub const ONCE: &str = "no request counted twice";
pub const SLOTS: &str =
    "slots: running requests <= max_concurrent + those whose lease lapsed as they ran";
pub const HELD: &str =
    "a slot is held only by a request that runs (or died, until its lease lapses)";
pub const ORDER: &str = "queue places granted in arrival order";
pub const SETTLED: &str = "after the faults stop: all settled, all freed, counter = ledger = told";

pub fn all() -> Vec<Property<System>> {
    vec![
        Property::always(BUDGET, |m, s| budget(m, s).is_ok()),
        Property::always(ONCE, |_, s: &State| once(s)),
        Property::always(SLOTS, slots),
        Property::always(HELD, |_, s: &State| held(s)),
        Property::always(ORDER, |_, s: &State| !s.ghost.out_of_order),
        Property::always(SETTLED, |m, s| quiesce(m, s).is_ok()),
        // Not vacuous: the checker must reach each of these.
        Property::sometimes("a waiter starts from the queue", |_, s: &State| {
            s.ghost.arrivals > 0
                && s.phases.iter().any(|p| matches!(p, Phase::Running { .. }))
                && s.redis.key.queue.is_empty()
        }),
        Property::sometimes(
            "a counter is seeded again after Redis lost its data",
            |_, s: &State| {
                s.spent.redis_losses > 0 && s.redis.key.used.is_some_and(|used| used > 0)
            },
        ),
    ]
}

/// What the client was told, summed.
fn told(s: &State) -> u64 {
    s.phases.iter().filter_map(Phase::told).sum()
}

/// Told usage stays within the budget, but for what the counters could not see: the
/// usage of requests whose reservation vanished while they were in flight (Redis lost
/// its data; or a slot lapsed and its reservation was dropped after two minutes) and of
/// rows settled but not yet in the ledger when Redis lost its data.
pub fn budget(m: &System, s: &State) -> Result<(), String> {
    let excused: u64 = if m.strict {
        0
    } else {
        s.ghost
            .unseen
            .union(&s.ghost.lost_rows)
            .filter_map(|&l| s.phases[usize::from(l)].told())
            .sum()
    };
    let told = told(s);
    if told > m.limits.budget + excused {
        return Err(format!(
            "told {told} > budget {} + {excused}",
            m.limits.budget
        ));
    }
    Ok(())
}

fn once(s: &State) -> bool {
    s.ghost.counted.values().all(|&n| n <= 1)
}

fn slots(m: &System, s: &State) -> bool {
    let running = s
        .phases
        .iter()
        .filter(|p| matches!(p, Phase::Running { .. }))
        .count() as u64;
    let overdue = if m.strict { 0 } else { s.ghost.overdue.len() };
    running <= m.limits.max_concurrent + overdue as u64
}

/// Every running slot in Redis is its request's while it runs: released when it is
/// settled or given back, left to lapse only when its replica died.
fn held(s: &State) -> bool {
    s.redis
        .key
        .run
        .keys()
        .all(|&lease| match s.phases[usize::from(lease)] {
            Phase::Running { .. } | Phase::GiveBack | Phase::Dead | Phase::DeadTold { .. } => true,
            Phase::Settling { .. } => !s.ghost.finished.contains(&lease),
            _ => false,
        })
}

/// How long after the faults stop every request must be over (settled, refused, or
/// dead with its replica): a dead holder's slot lapses (a lease), then a queue place
/// behind it is served or lapses (a queue TTL); a second of slack for each.
pub fn settle_within(m: &System) -> u64 {
    m.ttls.lease + m.ttls.queue + 2 * SECOND
}

/// The longest any continuation took to get every request over (µs), for the report.
pub static SLOWEST_SETTLEMENT: AtomicU64 = AtomicU64::new(0);

/// Lets the faults stop in `state` and the system run on by itself (dead replicas
/// restarted, the store back, every request carried on, time passing when nothing
/// else moves), then checks that everything settled: every request over; every slot,
/// queue place and reservation free once its lease (or the lapsed keep) ran out; every
/// row told to a client in the ledger, but those lost with a crashed replica; the
/// counter, where there is one, holding each ledger row once but those whose
/// reservation vanished in flight. Returns the settled state, or what failed.
pub fn quiesce(m: &System, state: &State) -> Result<State, String> {
    let mut s = state.clone();
    let start = s.now;
    let deadline = start + settle_within(m);
    let mut actions = Vec::new();
    loop {
        actions.clear();
        m.progress(&s, &mut actions);
        let next = actions.iter().find_map(|&a| {
            use stateright::Model;
            m.next_state(&s, a).filter(|n| *n != s)
        });
        if let Some(next) = next {
            s = next;
            continue;
        }
        if s.phases.iter().all(Phase::is_over) {
            SLOWEST_SETTLEMENT.fetch_max(s.now - start, Ordering::Relaxed);
            break;
        }
        if s.now >= deadline {
            return Err(format!("not settled by the deadline: {:?}", s.phases));
        }
        s.now += SECOND;
    }
    // Every lease has run out: the next script's purge frees what dead holders kept,
    // and their reservations count no more once the lapsed keep has run out too.
    // (A reservation whose whole slot set expired unseen is set aside when the
    // reservations are next counted, and kept from then.)
    s.now += m.ttls.lease.max(m.ttls.queue) + SECOND;
    s.redis.key.usage(s.now);
    let key = &s.redis.key;
    if !key.run.is_empty() || !key.queue.is_empty() || !key.grants.is_empty() {
        return Err(format!("slots or places still taken: {key:?}"));
    }
    s.now += LAPSED_KEEP_US + SECOND;
    if let Reply::Done(_, reserved @ 1..) = s.redis.key.usage(s.now) {
        return Err(format!(
            "{reserved} tokens still reserved: {:?}",
            s.redis.key
        ));
    }
    for (i, phase) in s.phases.iter().enumerate() {
        let lease = i as Lease;
        let row = s.store.get(&lease).copied();
        match phase.told() {
            Some(told)
                if row != Some(told) && (m.strict || !s.ghost.lost_rows.contains(&lease)) =>
            {
                return Err(format!(
                    "request {lease} was told {told}, the ledger has {row:?}"
                ));
            }
            None if row.is_some() => {
                return Err(format!("request {lease} has a ledger row but told nothing"));
            }
            _ => {}
        }
    }
    if !s.redis.journal.rows.is_empty() || s.replicas.iter().any(|r| !r.buffer.is_empty()) {
        return Err("rows still waiting for the ledger".to_owned());
    }
    if let Some(used) = s.redis.key.used {
        let counted = &s.ghost.counted;
        if let Some(l) = counted.keys().find(|l| !s.store.contains_key(l)) {
            return Err(format!(
                "the counter holds request {l}, the ledger does not"
            ));
        }
        if let Some(l) = s
            .store
            .keys()
            .find(|l| !counted.contains_key(l) && (m.strict || !s.ghost.unseen.contains(l)))
        {
            return Err(format!("the counter misses request {l}'s row"));
        }
        let sum: u64 = counted.keys().map(|l| s.store[l]).sum();
        if used != sum {
            return Err(format!("the counter says {used}, its rows sum to {sum}"));
        }
    }
    Ok(s)
}

/// Why `state` breaks a property, in words (for the report of a violation).
pub fn explain(m: &System, state: &State) -> String {
    let mut why = Vec::new();
    if let Err(err) = budget(m, state) {
        why.push(err);
    }
    if !once(state) {
        why.push(format!("counted: {:?}", state.ghost.counted));
    }
    if !slots(m, state) {
        why.push(format!("running: {:?}", state.phases));
    }
    if !held(state) {
        why.push(format!(
            "slots held: {:?}, phases: {:?}",
            state.redis.key.run, state.phases
        ));
    }
    if let Err(err) = quiesce(m, state) {
        why.push(err);
    }
    why.join("; ")
}
