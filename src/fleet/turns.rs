//! Whose turn it is in a model's fleet queue: when every node that is up is full, the
//! next free slot goes to a waiting request of the key that has been served least for
//! its `share`; within a key, in arrival order (`fleet.queue_order = "fair"`, the
//! default). With `"arrival"`, first come, first served, whoever's key it is.
//!
//! This is the Virtual Token Counter ("Fairness in Serving Large Language Models",
//! OSDI 2024). Each key has a counter of the service it got, in weighted tokens over its
//! share: a prompt token counts [`PROMPT_WEIGHT`], a generated one [`GENERATED_WEIGHT`]
//! (decoding a token holds a sequence's place in the batch, a prompt token is computed
//! in one pass with the others). A request is charged when a node takes it, at the most
//! it may cost (its prompt and `max_tokens` for each choice), and corrected to what it
//! did cost when it is settled ([`Charge::settle`]), so a key's counter counts its
//! requests in flight too.
//!
//! A key that had nothing waiting and comes back is lifted to the least counter of the
//! keys waiting, or when none waits to the counter of the key served last: service it
//! did not ask for while away is not banked, and a key cannot be starved by keys that
//! were served while it was away. While two keys both have requests waiting, their
//! counters stay within one request's cost of each other (plus what their requests in
//! flight are corrected by when they finish), which is the paper's bound.
//!
//! Fairness decides who goes next, not where: the waiter whose turn it is takes the
//! node its prompt's prefix routing picks (`model.rs`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::config::QueueOrder;

/// The weight of a prompt token in a key's service.
pub const PROMPT_WEIGHT: f64 = 1.0;
/// The weight of a generated token in a key's service.
pub const GENERATED_WEIGHT: f64 = 2.0;

/// Counters kept before the ones no key needs are forgotten (see [`Virtual::forget`]).
const FORGET_ABOVE: usize = 1024;

/// What a waiting (or just dispatched) request is charged to: its key, the key's share,
/// and its cost at most.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Turn {
    pub key: i64,
    /// The key's weight: at least 1.
    pub share: u32,
    /// Weighted tokens at most ([`Turn::cost`]).
    pub cost: f64,
}

impl Turn {
    /// A request of `key` with `prompt_tokens` that may generate up to `generated`.
    pub fn new(key: i64, share: u32, prompt_tokens: u64, generated: u64) -> Self {
        Self {
            key,
            share: share.max(1),
            cost: cost(prompt_tokens, generated),
        }
    }

    fn service(&self, cost: f64) -> f64 {
        cost / f64::from(self.share)
    }
}

fn cost(prompt_tokens: u64, generated: u64) -> f64 {
    prompt_tokens as f64 * PROMPT_WEIGHT + generated as f64 * GENERATED_WEIGHT
}

/// Every key's counter, shared by a model's queue and the charges of its requests in
/// flight.
#[derive(Default)]
pub struct Counters(Mutex<Virtual>);

#[derive(Default)]
struct Virtual {
    by_key: HashMap<i64, f64>,
    /// Service counted here since the last exchange with the other replicas.
    unshared: HashMap<i64, f64>,
    /// Each key's total over all replicas at the last exchange; empty before the first.
    shared: HashMap<i64, f64>,
    /// Whether service is exchanged with other replicas (else `unshared` stays empty).
    sharing: bool,
    /// The counter of the key served last, after its charge: where a key returning
    /// while nobody waits starts.
    last: f64,
    /// How many counters are kept before forgetting those no key needs.
    forget_above: usize,
}

impl Counters {
    fn lock(&self) -> MutexGuard<'_, Virtual> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A key's counter now (0 for one not served yet).
    #[cfg(test)]
    pub fn of(&self, key: i64) -> f64 {
        self.lock().counter(key)
    }

    /// The service counted here since the last exchange, for the other replicas
    /// (`background::service_exchange`); counted as exchanged from here on.
    pub fn unshared(&self) -> Vec<(i64, f64)> {
        let mut counters = self.lock();
        let taken = std::mem::take(&mut counters.unshared);
        taken
            .into_iter()
            .filter(|(_, amount)| *amount != 0.0)
            .collect()
    }

    /// Puts back service that could not be exchanged, for the next exchange.
    pub fn unshared_again(&self, mine: &[(i64, f64)]) {
        let mut counters = self.lock();
        for &(key, amount) in mine {
            *counters.unshared.entry(key).or_insert(0.0) += amount;
        }
    }

    /// Every key's service over all replicas (`totals`), after this replica added
    /// `mine`: what the others counted since the last exchange is added to the keys'
    /// counters, so a key that spreads its requests over replicas is counted whole on
    /// each. The first exchange only notes where the totals stand: what was served
    /// before this replica started is not charged again.
    pub fn absorb(&self, mine: &[(i64, f64)], totals: &[(i64, f64)]) {
        let mut counters = self.lock();
        let first = !std::mem::replace(&mut counters.sharing, true);
        let mine: HashMap<i64, f64> = mine.iter().copied().collect();
        for &(key, total) in totals {
            let before = counters.shared.insert(key, total);
            if first {
                continue;
            }
            let own = mine.get(&key).copied().unwrap_or(0.0);
            // A total below what was seen: its hash expired while idle. Start again.
            let others = (total - before.unwrap_or(0.0) - own).max(0.0);
            if others > 0.0 {
                *counters.by_key.entry(key).or_insert(0.0) += others;
            }
        }
    }
}

impl Virtual {
    fn counter(&self, key: i64) -> f64 {
        self.by_key.get(&key).copied().unwrap_or(0.0)
    }

    /// Lifts `key` to at least `floor`.
    fn lift(&mut self, key: i64, floor: f64) {
        let counter = self.by_key.entry(key).or_insert(floor);
        *counter = counter.max(floor);
    }

    /// Charges `turn` as its request is given a node.
    fn charge(&mut self, turn: &Turn) {
        let service = turn.service(turn.cost);
        let counter = self.by_key.entry(turn.key).or_insert(0.0);
        *counter += service;
        self.last = *counter;
        if self.sharing {
            *self.unshared.entry(turn.key).or_insert(0.0) += service;
        }
    }

    /// Forgets the counters at or below `floor` once there are many: a key whose
    /// counter is at most the floor of its next lift starts there anyway. Amortised:
    /// the next pass waits until the map has doubled.
    fn forget(&mut self, floor: f64) {
        if self.by_key.len() <= self.forget_above.max(FORGET_ABOVE) {
            return;
        }
        self.by_key.retain(|_, counter| *counter > floor);
        self.forget_above = 2 * self.by_key.len();
    }
}

/// A request's charge while it is on a node, corrected to what it cost when settled;
/// dropped unsettled (the request never ran), it is taken back whole.
pub struct Charge {
    counters: Arc<Counters>,
    turn: Turn,
    settled: bool,
}

impl Charge {
    fn new(counters: &Arc<Counters>, turn: Turn) -> Self {
        Self {
            counters: Arc::clone(counters),
            turn,
            settled: false,
        }
    }

    /// The request used `prompt_tokens` and generated `generated`: its key's counter
    /// counts that instead of the most it could have cost.
    pub fn settle(mut self, prompt_tokens: u64, generated: u64) {
        self.correct(cost(prompt_tokens, generated));
    }

    fn correct(&mut self, used: f64) {
        self.settled = true;
        let unused = self.turn.service(self.turn.cost - used);
        let mut counters = self.counters.lock();
        if counters.sharing {
            *counters.unshared.entry(self.turn.key).or_insert(0.0) -= unused;
        }
        // A forgotten counter was at the floor: nothing to correct.
        if let Some(counter) = counters.by_key.get_mut(&self.turn.key) {
            *counter -= unused;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if !self.settled {
            self.correct(0.0);
        }
    }
}

/// One model's waiting requests, each holding `W` (what its waiter needs to be given a
/// node), and the counters that order them.
pub struct Turns<W> {
    order: QueueOrder,
    waiting: Mutex<Waiting<W>>,
    counters: Arc<Counters>,
}

struct Waiting<W> {
    next_ticket: u64,
    /// The keys with requests waiting, each's in arrival order.
    keys: HashMap<i64, VecDeque<Place<W>>>,
}

struct Place<W> {
    ticket: u64,
    turn: Turn,
    what: W,
}

/// A waiting request: its key and its place in the key's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    key: i64,
    number: u64,
}

impl<W> Turns<W> {
    pub fn new(order: QueueOrder) -> Self {
        Self {
            order,
            waiting: Mutex::new(Waiting {
                next_ticket: 0,
                keys: HashMap::new(),
            }),
            counters: Arc::default(),
        }
    }

    /// The keys' counters.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// Charges a request given a node without waiting (nobody was): its key is lifted
    /// to the key served last first, as one that comes back.
    pub fn charge_now(&self, turn: Turn) -> Charge {
        let mut counters = self.counters.lock();
        let last = counters.last;
        counters.lift(turn.key, last);
        counters.charge(&turn);
        counters.forget(last);
        drop(counters);
        Charge::new(&self.counters, turn)
    }

    /// The queue, to join, leave or hand slots out in turn; locked while held.
    pub fn lock(&self) -> Queue<'_, W> {
        Queue {
            waiting: self.waiting.lock().unwrap_or_else(PoisonError::into_inner),
            turns: self,
        }
    }
}

/// A model's queue, locked.
pub struct Queue<'a, W> {
    waiting: MutexGuard<'a, Waiting<W>>,
    turns: &'a Turns<W>,
}

impl<W> Queue<'_, W> {
    /// Puts a request in line; a key that had nothing waiting is lifted to the least
    /// counter of those waiting (or to the key served last).
    pub fn join(&mut self, turn: Turn, what: W) -> Ticket {
        let mut counters = self.turns.counters.lock();
        if !self.waiting.keys.contains_key(&turn.key) {
            let floor = self.floor(&counters);
            counters.lift(turn.key, floor);
            let below = floor.min(counters.last);
            counters.forget(below);
        }
        drop(counters);
        let number = self.waiting.next_ticket;
        self.waiting.next_ticket += 1;
        self.waiting
            .keys
            .entry(turn.key)
            .or_default()
            .push_back(Place {
                ticket: number,
                turn,
                what,
            });
        Ticket {
            key: turn.key,
            number,
        }
    }

    /// The least counter of the keys waiting, or the counter of the key served last.
    fn floor(&self, counters: &Virtual) -> f64 {
        self.waiting
            .keys
            .keys()
            .map(|&key| counters.counter(key))
            .min_by(f64::total_cmp)
            .unwrap_or(counters.last)
    }

    /// The waiting requests, the one whose turn it is first.
    pub fn in_order(&self) -> Vec<Ticket> {
        let tickets = |key: i64, line: &VecDeque<Place<W>>| {
            line.iter()
                .map(move |place| Ticket {
                    key,
                    number: place.ticket,
                })
                .collect::<Vec<_>>()
        };
        match self.turns.order {
            // Each key's line behind its front, in the order of the fronts: whoever
            // comes after the first can only go when the first cannot.
            QueueOrder::Fair => {
                let mut fronts = self.fair_fronts();
                fronts.sort_by(|a, b| in_turn(&a.0, &b.0));
                fronts
                    .into_iter()
                    .flat_map(|(_, key)| tickets(key, &self.waiting.keys[&key]))
                    .collect()
            }
            QueueOrder::Arrival => {
                let mut order: Vec<Ticket> = self
                    .waiting
                    .keys
                    .iter()
                    .flat_map(|(&key, line)| tickets(key, line))
                    .collect();
                order.sort_by_key(|ticket| ticket.number);
                order
            }
        }
    }

    /// The request whose turn it is: the front of the line of the key with the least
    /// counter; on a tie, of the key with fewer requests waiting, then the earlier. (By
    /// arrival alone a tie would go to the key with the deeper backlog, whose front is
    /// always older; with several replicas, whose counters move in the same steps, ties
    /// come often enough that this tilted two keys' shares to 56 : 44.)
    pub fn first(&self) -> Option<Ticket> {
        match self.turns.order {
            QueueOrder::Fair => self
                .fair_fronts()
                .into_iter()
                .min_by(|a, b| in_turn(&a.0, &b.0))
                .map(|((.., number), key)| Ticket { key, number }),
            QueueOrder::Arrival => self
                .waiting
                .keys
                .iter()
                .filter_map(|(&key, line)| Some((line.front()?.ticket, key)))
                .min()
                .map(|(number, key)| Ticket { key, number }),
        }
    }

    /// Each waiting key's rank in fair order, beside the key: its counter, how many it
    /// has waiting, its front's ticket.
    fn fair_fronts(&self) -> Vec<((f64, usize, u64), i64)> {
        let counters = self.turns.counters.lock();
        self.waiting
            .keys
            .iter()
            .filter_map(|(&key, line)| {
                Some((
                    (counters.counter(key), line.len(), line.front()?.ticket),
                    key,
                ))
            })
            .collect()
    }

    /// What the waiter of `ticket` holds.
    pub fn what(&self, ticket: Ticket) -> Option<&W> {
        let line = self.waiting.keys.get(&ticket.key)?;
        line.iter()
            .find(|place| place.ticket == ticket.number)
            .map(|place| &place.what)
    }

    /// Takes `ticket` out of line, charged: a node took its request.
    pub fn served(&mut self, ticket: Ticket) -> Option<(W, Charge)> {
        let place = self.remove_place(ticket)?;
        self.turns.counters.lock().charge(&place.turn);
        Some((place.what, Charge::new(&self.turns.counters, place.turn)))
    }

    /// Takes `ticket` out of line uncharged (it left, or no node is up for it);
    /// `None` when it is not in line (it was served).
    pub fn remove(&mut self, ticket: Ticket) -> Option<W> {
        self.remove_place(ticket).map(|place| place.what)
    }

    fn remove_place(&mut self, ticket: Ticket) -> Option<Place<W>> {
        let line = self.waiting.keys.get_mut(&ticket.key)?;
        let at = line
            .iter()
            .position(|place| place.ticket == ticket.number)?;
        let place = line.remove(at);
        if line.is_empty() {
            self.waiting.keys.remove(&ticket.key);
        }
        place
    }
}

/// Fair order between two keys' ranks ([`Queue::first`]): the lesser counter, then
/// fewer waiting, then the earlier front.
fn in_turn(a: &(f64, usize, u64), b: &(f64, usize, u64)) -> std::cmp::Ordering {
    a.0.total_cmp(&b.0).then((a.1, a.2).cmp(&(b.1, b.2)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(key: i64, share: u32) -> Turn {
        Turn::new(key, share, 10, 45)
    }

    /// Serves `n` requests in turn from a queue every key keeps full (`lines`: key,
    /// share), each refilled as it is served; the keys in the order served.
    fn serve_backlogged(order: QueueOrder, lines: &[(i64, u32, usize)], n: usize) -> Vec<i64> {
        let turns: Turns<()> = Turns::new(order);
        let mut queue = turns.lock();
        for &(key, share, depth) in lines {
            for _ in 0..depth {
                queue.join(turn(key, share), ());
            }
        }
        (0..n)
            .map(|_| {
                let first = queue.first().unwrap();
                let (_, charge) = queue.served(first).unwrap();
                charge.settle(10, 45);
                let share = lines.iter().find(|l| l.0 == first.key).unwrap().1;
                queue.join(turn(first.key, share), ());
                first.key
            })
            .collect()
    }

    fn count(served: &[i64], key: i64) -> usize {
        served.iter().filter(|&&k| k == key).count()
    }

    #[test]
    fn backlogged_keys_are_served_evenly_whatever_their_depth_and_by_share() {
        let fair = serve_backlogged(QueueOrder::Fair, &[(1, 1, 48), (2, 1, 8)], 200);
        assert_eq!((count(&fair, 1), count(&fair, 2)), (100, 100));
        let fifo = serve_backlogged(QueueOrder::Arrival, &[(1, 1, 48), (2, 1, 8)], 560);
        assert_eq!((count(&fifo, 1), count(&fifo, 2)), (480, 80), "by depth");
        let weighted = serve_backlogged(QueueOrder::Fair, &[(1, 2, 8), (2, 1, 8)], 300);
        assert_eq!((count(&weighted, 1), count(&weighted, 2)), (200, 100));
    }

    #[test]
    fn a_returning_key_goes_next_but_banks_nothing_from_its_absence() {
        let turns: Turns<()> = Turns::new(QueueOrder::Fair);
        let mut queue = turns.lock();
        for _ in 0..10 {
            queue.join(turn(1, 1), ());
        }
        for _ in 0..5 {
            let first = queue.first().unwrap();
            assert_eq!(first.key, 1);
            queue.served(first).unwrap().1.settle(10, 45);
        }
        // Key 2 was away while key 1 was served five times: it starts level with key 1,
        // not five requests behind, and they take turns (a tie goes to the key with fewer
        // waiting).
        queue.join(turn(2, 1), ());
        queue.join(turn(2, 1), ());
        let mut served = Vec::new();
        for _ in 0..4 {
            let first = queue.first().unwrap();
            queue.served(first).unwrap().1.settle(10, 45);
            served.push(first.key);
        }
        assert_eq!(served, [2, 1, 2, 1]);
        assert_eq!(turns.counters().of(1), turns.counters().of(2));
    }

    #[test]
    fn a_charge_is_corrected_to_what_the_request_used() {
        let turns: Turns<()> = Turns::new(QueueOrder::Fair);
        let charge = turns.charge_now(Turn::new(7, 2, 10, 100));
        assert_eq!(turns.counters().of(7), (10.0 + 200.0) / 2.0);
        charge.settle(10, 5);
        assert_eq!(turns.counters().of(7), (10.0 + 10.0) / 2.0);
    }

    #[test]
    fn within_a_key_arrival_order_and_a_request_that_left_is_gone() {
        let turns: Turns<u32> = Turns::new(QueueOrder::Fair);
        let mut queue = turns.lock();
        let tickets: Vec<_> = (0..3).map(|i| queue.join(turn(1, 1), i)).collect();
        assert_eq!(queue.remove(tickets[1]), Some(1));
        assert_eq!(queue.remove(tickets[1]), None, "already gone");
        assert_eq!(queue.in_order(), [tickets[0], tickets[2]]);
        assert_eq!(queue.what(tickets[2]), Some(&2));
    }

    #[test]
    fn what_other_replicas_served_a_key_counts_here_and_history_does_not() {
        let turns: Turns<()> = Turns::new(QueueOrder::Fair);
        let counters = turns.counters();
        assert!(counters.unshared().is_empty(), "nothing to share yet");
        // The first exchange: 500 served before this replica started is not charged.
        counters.absorb(&[], &[(1, 500.0)]);
        assert_eq!(counters.of(1), 0.0);
        turns.charge_now(turn(1, 1)).settle(10, 45);
        let mine = counters.unshared();
        assert_eq!(mine, [(1, 100.0)]);
        // Another replica served the key 300 meanwhile.
        counters.absorb(&mine, &[(1, 900.0)]);
        assert_eq!(counters.of(1), 400.0);
        // An exchange that failed keeps its part for the next.
        turns.charge_now(turn(1, 1)).settle(10, 45);
        let mine = counters.unshared();
        counters.unshared_again(&mine);
        assert_eq!(counters.unshared(), mine);
    }

    #[test]
    fn counters_no_key_needs_are_forgotten() {
        let turns: Turns<()> = Turns::new(QueueOrder::Fair);
        for key in 0..10 * FORGET_ABOVE as i64 {
            turns.charge_now(turn(key, 1)).settle(10, 45);
        }
        assert!(turns.counters.lock().by_key.len() <= 2 * FORGET_ABOVE + 1);
    }
}
