//! What the limiter's Lua scripts (`src/admission/redis/*.lua`) do to one API key's data
//! and to the usage journal, step for step, as plain Rust on plain maps: the model
//! checker runs these, and the conformance test runs the real scripts beside them on a
//! real Redis and compares the data after every call.
//!
//! Leases and writers are small numbers here (`r3`, `w1` in Redis); time is Redis's
//! clock in µs, passed in (`now`), since a script reads `TIME` once. What the model
//! leaves out, because no decision reads it: key expiries (`tidy`, `expire_no_sooner`;
//! an expiry that matters, a slot set or a heartbeat gone, is an action of the model of
//! its own), wake-up messages (`announce`: a lost one is made up by the next poll) and
//! the rows' text (a row is its tokens).

use std::collections::{BTreeMap, BTreeSet};

/// A request id (the lease of its slot, queue place and reservation).
pub type Lease = u8;
/// A replica's ledger writer (one per process start).
pub type Writer = u8;

/// `LAPSED_KEEP_US` in `common.lua`: how long a lapsed slot's reservation still counts.
pub const LAPSED_KEEP_US: u64 = 120_000_000;

/// The bookkeeping fields beside the reservations in `grants` (`#running`, `#lapsed`,
/// `#sum:<month>`; one month here). Each may be missing, as in Redis.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Book {
    pub running: Option<i64>,
    pub lapsed: Option<i64>,
    pub sum: Option<i64>,
}

/// One API key's data (`P:{id}:*`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Key {
    /// `rate`: the GCRA's theoretical arrival time.
    pub rate: Option<u64>,
    /// `run`: running lease → expiry.
    pub run: BTreeMap<Lease, u64>,
    /// `grants`, running reservations: lease → reserved tokens.
    pub grants: BTreeMap<Lease, u64>,
    /// `grants`, lapsed ones (`~lease`): lease → (reserved tokens, lapsed at).
    pub lapsed: BTreeMap<Lease, (u64, u64)>,
    pub book: Book,
    /// `queue`: waiting lease → ticket.
    pub queue: BTreeMap<Lease, u64>,
    /// `qexp`: waiting lease → expiry.
    pub qexp: BTreeMap<Lease, u64>,
    /// `used:<month>`, the month's used tokens; missing until seeded.
    pub used: Option<u64>,
}

/// The usage journal (`P:unwritten:<writer>`, `P:writers`, `P:alive:<writer>`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Journal {
    /// Writer → request id → the row's tokens.
    pub rows: BTreeMap<Writer, BTreeMap<Lease, u64>>,
    pub writers: BTreeSet<Writer>,
    pub alive: BTreeSet<Writer>,
}

/// Everything the protocol keeps in Redis, for one API key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Redis {
    pub key: Key,
    pub journal: Journal,
}

/// A key's limits, as the scripts get them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limits {
    /// 0: the start does not count against the rate.
    pub rpm: u64,
    pub max_concurrent: u64,
    pub max_queued: u64,
    pub budget: u64,
}

/// A request's cost, as the scripts get it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cost {
    pub prompt: u64,
    pub fan_out: u64,
    pub max_tokens: u64,
}

/// The lease and queue-place TTLs (µs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ttls {
    pub lease: u64,
    pub queue: u64,
}

/// A script's reply (the codes of `common.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reply {
    Running {
        fit: u64,
        hold: u64,
    },
    Queued,
    RateLimited {
        wait: u64,
    },
    QueueFull,
    Budget {
        used: u64,
        reserved: u64,
        needed: u64,
    },
    Seed,
    Wait,
    Gone,
    /// `DONE` and the values after it.
    Done(u64, u64),
}

/// The leases of a lease set (`run`, `qexp`) that have expired by `now`.
fn due(expiries: &BTreeMap<Lease, u64>, now: u64) -> Vec<Lease> {
    expiries
        .iter()
        .filter(|&(_, &until)| until <= now)
        .map(|(&lease, _)| lease)
        .collect()
}

impl Key {
    /// `purge`: lapsed slots set aside with their reservations, lapsed queue places
    /// dropped (looked for only while somebody waits). How many went, how many wait.
    fn purge(&mut self, now: u64) -> (u64, u64) {
        let mut n = 0;
        for lease in due(&self.run, now) {
            self.run.remove(&lease);
            if let Some(reserved) = self.grants.remove(&lease) {
                self.lapsed.insert(lease, (reserved, now));
                self.count_moved(true);
            }
            n += 1;
        }
        let mut waiting = self.queue.len() as u64;
        if waiting > 0 {
            for lease in due(&self.qexp, now) {
                self.qexp.remove(&lease);
                if self.queue.remove(&lease).is_some() {
                    waiting -= 1;
                }
                n += 1;
            }
        }
        (n, waiting)
    }

    /// `count_moved`: one reservation from running to lapsed (or back), where the
    /// bookkeeping is kept (`#running` there).
    fn count_moved(&mut self, to_lapsed: bool) {
        if self.book.running.is_none() {
            return;
        }
        let step = if to_lapsed { 1 } else { -1 };
        self.book.running = Some(self.book.running.unwrap_or(0) - step);
        self.book.lapsed = Some(self.book.lapsed.unwrap_or(0) + step);
    }

    /// `recount`: the reservations read anew; lapsed ones kept long enough dropped,
    /// running ones without a slot set aside as lapsed; the bookkeeping written anew.
    fn recount(&mut self, now: u64) -> (u64, u64) {
        let (mut running, mut lapsed, mut sum) = (0, 0, 0);
        self.lapsed.retain(|_, &mut (reserved, at)| {
            let kept = now.saturating_sub(at) <= LAPSED_KEEP_US;
            if kept {
                lapsed += 1;
                sum += reserved;
            }
            kept
        });
        let grants = std::mem::take(&mut self.grants);
        for (lease, reserved) in grants {
            if self.run.contains_key(&lease) {
                running += 1;
                self.grants.insert(lease, reserved);
            } else {
                self.lapsed.insert(lease, (reserved, now));
                lapsed += 1;
            }
            sum += reserved;
        }
        self.book = Book::default();
        if running + lapsed > 0 {
            self.book = Book {
                running: Some(running),
                lapsed: Some(lapsed),
                sum: Some(sum as i64),
            };
        }
        (sum, running as u64)
    }

    /// `reserved_in`: as kept, when the bookkeeping needs no look; else recounted.
    fn reserved_in(&mut self, now: u64, slots: u64) -> (u64, u64) {
        if let Some(running) = self.book.running
            && self.book.lapsed.unwrap_or(0) == 0
            && running == slots as i64
        {
            return (self.book.sum.unwrap_or(0) as u64, slots);
        }
        self.recount(now)
    }

    /// `start`: reserves the budget and takes a slot, or refuses on the budget.
    fn start(
        &mut self,
        lease: Lease,
        limits: &Limits,
        cost: &Cost,
        now: u64,
        ttls: &Ttls,
    ) -> Reply {
        let used = self.used.unwrap_or(0);
        let slots = self.run.len() as u64;
        let (reserved, running) = self.reserved_in(now, slots);
        let available = limits.budget.saturating_sub(used).saturating_sub(reserved);
        let mut fit = 0;
        if available >= cost.prompt {
            fit = ((available - cost.prompt) / cost.fan_out.max(1)).min(cost.max_tokens);
        }
        if fit < 1 {
            return Reply::Budget {
                used,
                reserved,
                needed: cost.prompt + cost.fan_out,
            };
        }
        let hold = cost.prompt + cost.fan_out * fit;
        self.run.insert(lease, now + ttls.lease);
        self.grants.insert(lease, hold);
        self.book.running = Some(running as i64 + 1);
        self.book.sum = Some((reserved + hold) as i64);
        Reply::Running { fit, hold }
    }

    /// `rate_wait`: how long until a start is allowed, and the arrival time after it.
    fn rate_wait(&self, rpm: u64, now: u64) -> (u64, u64) {
        let interval = 60_000_000 / rpm;
        let tolerance = interval * (rpm - 1);
        let tat = self.rate.unwrap_or(now).max(now);
        (
            (tat as i64 - tolerance as i64 - now as i64).max(0) as u64,
            tat + interval,
        )
    }

    /// `take_rate`: counts a start, or says how long until one is allowed.
    fn take_rate(&mut self, rpm: u64, now: u64) -> Option<u64> {
        let (wait, next) = self.rate_wait(rpm, now);
        if wait > 0 {
            return Some(wait);
        }
        self.rate = Some(next);
        None
    }

    /// `admit.lua`.
    pub fn admit(
        &mut self,
        lease: Lease,
        limits: &Limits,
        cost: &Cost,
        now: u64,
        ttls: &Ttls,
    ) -> Reply {
        if self.used.is_none() {
            return Reply::Seed;
        }
        let (_, waiting) = self.purge(now);
        if limits.rpm > 0
            && let Some(wait) = self.take_rate(limits.rpm, now)
        {
            return Reply::RateLimited { wait };
        }
        if waiting == 0 && (self.run.len() as u64) < limits.max_concurrent {
            return self.start(lease, limits, cost, now, ttls);
        }
        if waiting >= limits.max_queued {
            return Reply::QueueFull;
        }
        let ticket = self.queue.values().max().map_or(1, |last| last + 1);
        self.queue.insert(lease, ticket);
        self.qexp.insert(lease, now + ttls.queue);
        Reply::Queued
    }

    /// `turn.lua`.
    pub fn turn(
        &mut self,
        lease: Lease,
        limits: &Limits,
        cost: &Cost,
        now: u64,
        ttls: &Ttls,
    ) -> Reply {
        self.purge(now);
        let Some(&until) = self.qexp.get(&lease) else {
            return Reply::Gone;
        };
        if (until as i64 - now as i64) < (ttls.queue / 2) as i64 {
            self.qexp.insert(lease, now + ttls.queue);
        }
        let first = self
            .queue
            .iter()
            .min_by_key(|&(_, &ticket)| ticket)
            .map(|(&l, _)| l);
        if first != Some(lease) || self.run.len() as u64 >= limits.max_concurrent {
            return Reply::Wait;
        }
        if self.used.is_none() {
            return Reply::Seed;
        }
        self.queue.remove(&lease);
        self.qexp.remove(&lease);
        self.start(lease, limits, cost, now, ttls)
    }

    /// `leave.lua`.
    pub fn leave(&mut self, lease: Lease, now: u64) -> Reply {
        self.purge(now);
        self.queue.remove(&lease);
        self.qexp.remove(&lease);
        Reply::Done(0, 0)
    }

    /// `finish.lua` without its journal (the journal's part is [`Redis::finish`]).
    /// Whether a reservation was found and settled.
    fn finish(&mut self, lease: Lease, used_tokens: u64, now: u64) -> bool {
        if !self.queue.is_empty() {
            self.purge(now);
        }
        self.run.remove(&lease);
        let running = self.grants.remove(&lease);
        let lapsed = self.lapsed.remove(&lease).map(|(reserved, _)| reserved);
        if running.is_none() && lapsed.is_none() {
            return false;
        }
        if let Some(count) = self.book.running {
            let mut counts = [count, self.book.lapsed.unwrap_or(0)];
            let mut sum = self.book.sum.unwrap_or(0);
            for (i, found) in [running, lapsed].into_iter().enumerate() {
                if let Some(reserved) = found {
                    counts[i] -= 1;
                    sum -= reserved as i64;
                }
            }
            self.book = Book {
                running: Some(counts[0]),
                lapsed: Some(counts[1]),
                sum: Some(sum),
            };
        }
        if let Some(used) = &mut self.used {
            *used += used_tokens;
        }
        true
    }

    /// `renew.lua`: whether the lease was found (running, or taken back).
    pub fn renew(&mut self, lease: Lease, now: u64, ttls: &Ttls) -> Reply {
        self.purge(now);
        let until = now + ttls.lease;
        let mut found = 1;
        if self.run.contains_key(&lease) || self.grants.contains_key(&lease) {
            self.run.insert(lease, until);
        } else if let Some((reserved, _)) = self.lapsed.remove(&lease) {
            self.grants.insert(lease, reserved);
            self.count_moved(false);
            self.run.insert(lease, until);
        } else {
            found = 0;
        }
        Reply::Done(found, 0)
    }

    /// `usage.lua`: used and reserved tokens.
    pub fn usage(&mut self, now: u64) -> Reply {
        self.purge(now);
        let Some(used) = self.used else {
            return Reply::Seed;
        };
        let (reserved, _) = self.reserved_in(now, self.run.len() as u64);
        Reply::Done(used, reserved)
    }

    /// `occupancy.lua`: running and waiting leases.
    pub fn occupancy(&mut self, now: u64) -> Reply {
        let (_, waiting) = self.purge(now);
        Reply::Done(self.run.len() as u64, waiting)
    }

    /// `peek.lua`: whether admit would refuse on the rate or the full queue.
    pub fn peek(&mut self, limits: &Limits, now: u64) -> Reply {
        if limits.rpm > 0 {
            let (wait, _) = self.rate_wait(limits.rpm, now);
            if wait > 0 {
                return Reply::RateLimited { wait };
            }
        }
        let (_, waiting) = self.purge(now);
        if (waiting > 0 || self.run.len() as u64 >= limits.max_concurrent)
            && waiting >= limits.max_queued
        {
            return Reply::QueueFull;
        }
        Reply::Done(0, 0)
    }

    /// `rate.lua`: one start counted against the rate (`rpm` at least 1).
    pub fn rate(&mut self, rpm: u64, now: u64) -> Reply {
        match self.take_rate(rpm.max(1), now) {
            Some(wait) => Reply::RateLimited { wait },
            None => Reply::Done(0, 0),
        }
    }

    /// The seeding of a missing counter (`SET … NX`, in `limiter.rs`).
    pub fn seed(&mut self, value: u64) {
        self.used.get_or_insert(value);
    }
}

impl Redis {
    /// `finish.lua`: settles the key's reservation and, with a journal (`writer`),
    /// journals the row when it used tokens. The reply's value: whether it settled.
    pub fn finish(
        &mut self,
        lease: Lease,
        used_tokens: u64,
        writer: Option<Writer>,
        now: u64,
    ) -> Reply {
        let settled = self.key.finish(lease, used_tokens, now);
        if let Some(writer) = writer
            && used_tokens > 0
        {
            self.journal
                .rows
                .entry(writer)
                .or_default()
                .insert(lease, used_tokens);
            self.journal.writers.insert(writer);
        }
        Reply::Done(u64::from(settled), 0)
    }

    /// `adopt.lua`: the rows of `theirs` moved into `ours`, unless `theirs` is alive.
    pub fn adopt(&mut self, theirs: Writer, ours: Writer) -> Vec<(Lease, u64)> {
        let journal = &mut self.journal;
        if journal.alive.contains(&theirs) {
            return Vec::new();
        }
        let moved: Vec<(Lease, u64)> = journal
            .rows
            .remove(&theirs)
            .map(|rows| rows.into_iter().collect())
            .unwrap_or_default();
        if !moved.is_empty() {
            journal
                .rows
                .entry(ours)
                .or_default()
                .extend(moved.iter().copied());
            journal.writers.insert(ours);
        }
        journal.writers.remove(&theirs);
        moved
    }

    /// The journal's heartbeat (`SET P:alive:<writer>`).
    pub fn beat(&mut self, writer: Writer) {
        self.journal.alive.insert(writer);
    }

    /// A committed row forgotten (`HDEL` of the writer's journal).
    pub fn forget(&mut self, writer: Writer, lease: Lease) {
        if let Some(rows) = self.journal.rows.get_mut(&writer) {
            rows.remove(&lease);
            if rows.is_empty() {
                self.journal.rows.remove(&writer);
            }
        }
    }
}
