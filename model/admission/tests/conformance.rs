//! Conformance: the model's mirror of the limiter's Lua scripts
//! (`admission_model::scripts`) held to the real scripts, on a real Redis.
//!
//! What it shows: along random traces of every script and of what happens to the data
//! outside them (a used counter seeded, the journal's heartbeat beating or lapsing, a
//! committed row forgotten, a slot set expiring, the bookkeeping missing as an older
//! version left it, data lost, time passing), each
//! script's reply and the whole of the data it leaves behind are what the model's
//! function says — after every step. What is proved of the model (the model checker
//! runs these functions) then holds of the scripts for every decision they take and
//! every byte of protocol data they keep; not for what the model leaves out on
//! purpose: key expiries (`tidy`, `expire_no_sooner`) and wake-up messages.
//!
//! How:
//! - The scripts are the files the gateway embeds, each `common.lua` followed by its
//!   own file as `limiter.rs`'s `script!` builds them (`adopt.lua` alone), called with
//!   the keys and arguments in `limiter.rs`'s (and `journal_store.rs`'s) order.
//! - The clock: the scripts read Redis's `TIME` once (`now_us()` in `common.lua`). The
//!   test replaces that one call, in the text of `common.lua` only, with a read of a
//!   key it owns (`P:clock`, whole seconds), and asserts it replaced exactly one, so a
//!   change to how the scripts read the clock fails here loudly. The fake clock starts
//!   at the real Unix time and only moves forward, since the scripts set expiries
//!   (`PEXPIREAT`) from it: behind real time, Redis would drop keys at once that the
//!   model keeps.
//! - Expiries the model does have are steps of the trace, done by hand (`DEL`): a slot
//!   set expiring whole, a heartbeat lapsing. Redis's own expiries never fire during a
//!   trace: every one the scripts set is at least 11 s of real time away (the fake
//!   clock is never behind the real one), and each trace, on data wiped before it,
//!   takes milliseconds.
//! - One normalisation, of the `rate` key: Redis expires it on the real clock
//!   (`PX`, relative), the model never. A GCRA arrival time at or before now decides
//!   exactly what no arrival time decides (`max(tat, now)`), so it is treated as absent
//!   on both sides.
//! - The GCRA, the budget and the tickets need no further care: the fake time is whole
//!   seconds in µs (about 1.8e15), exact in Lua's doubles and in zset scores.
//! - The steps are drawn from the trace's seed with an eye on the model's data (see
//!   [`Step::random`]), so the rarer paths are taken in every run; each run prints how
//!   often it took each (with `--nocapture`).
//!
//! Names: a fresh prefix `P` per test (`fgmodel-<pid>-<nanos>-<tag>`), one API key
//! (`P:{7}:*`), one month (`2026-12`); lease `n` is `r<n>`, writer `n` is `w<n>`. All
//! of `P:*` is deleted at the end, also when the test fails.
//!
//! Replay: a divergence prints its trace (seed, limits, costs, every step with the
//! fake time since the trace began) and what differs; `CONFORMANCE_SEED=<seed>` runs
//! that trace alone, `CONFORMANCE_TRACES=<n>` runs more traces than the default.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{Debug, Write as _};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use admission_model::scripts::{
    Book, Cost, Journal, Key, Lease, Limits, Redis, Reply, Ttls, Writer,
};
use redis::{Connection, Script, ScriptInvocation, Value};

const COMMON: &str = include_str!("../../../src/admission/redis/common.lua");
const ADMIT: &str = include_str!("../../../src/admission/redis/admit.lua");
const TURN: &str = include_str!("../../../src/admission/redis/turn.lua");
const LEAVE: &str = include_str!("../../../src/admission/redis/leave.lua");
const FINISH: &str = include_str!("../../../src/admission/redis/finish.lua");
const RENEW: &str = include_str!("../../../src/admission/redis/renew.lua");
const USAGE: &str = include_str!("../../../src/admission/redis/usage.lua");
const OCCUPANCY: &str = include_str!("../../../src/admission/redis/occupancy.lua");
const PEEK: &str = include_str!("../../../src/admission/redis/peek.lua");
const RATE: &str = include_str!("../../../src/admission/redis/rate.lua");
const ADOPT: &str = include_str!("../../../src/admission/redis/adopt.lua");

/// The one clock reading in `common.lua`, which the test's clock replaces.
const TIME_CALL: &str = "redis.call('TIME')";
/// The line of `finish.lua` the broken copy leaves out: the slot is not released.
const FINISH_RELEASE: &str = "redis.call('ZREM', run, lease)\n";

const KEY_ID: &str = "7";
const MONTH: &str = "2026-12";
/// Leases `r1..=r5`, writers `w1..=w3`.
const LEASES: u64 = 5;
const WRITERS: u64 = 3;
/// `journal::ADOPT_BATCH`: rows moved per adoption step.
const ADOPT_BATCH: u64 = 500;
/// The seeded counter's expiry (`seed` in `limiter.rs`: the month's end and 40 days;
/// far beyond any trace either way).
const SEED_TTL_SECS: u64 = 40 * 24 * 3600;
/// `LAPSED_KEEP` (120 s) in seconds: the clock's jumps are about as long.
const LAPSED_KEEP_SECS: u64 = 120;

const TRACES: usize = 500;
const STEPS: usize = 40;
/// The traces' seeds are drawn from this one, so CI runs the same traces every time.
const MASTER_SEED: u64 = 0x00f1_ee79_a7e5_eed5;

/// splitmix64: small, seeded, and enough for picking steps.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (the bias of `%` does not matter here).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    fn lease(&mut self) -> Lease {
        self.range(1, LEASES) as Lease
    }

    fn writer(&mut self) -> Writer {
        self.range(1, WRITERS) as Writer
    }

    /// Mostly (five times in six) one of `likely`, when there is one; else `any`.
    fn pick<T: Copy>(&mut self, likely: &[T], any: fn(&mut Rng) -> T) -> T {
        if likely.is_empty() || self.range(0, 5) == 0 {
            return any(self);
        }
        likely[self.range(0, likely.len() as u64 - 1) as usize]
    }
}

/// One step of a trace: a script run, or something that happens to the data or the
/// clock between scripts.
#[derive(Clone, Copy, Debug)]
enum Step {
    Admit(Lease),
    Turn(Lease),
    Leave(Lease),
    /// `tokens` used, `prompt` of them the row's prompt tokens; journaled by `writer`.
    Finish {
        lease: Lease,
        tokens: u64,
        prompt: u64,
        writer: Option<Writer>,
    },
    Renew(Lease),
    Usage,
    Occupancy,
    Peek,
    Rate,
    /// The used counter seeded (`SET NX`) with this many tokens.
    Seed(u64),
    Adopt {
        theirs: Writer,
        ours: Writer,
    },
    /// The writer's heartbeat (`SET P:alive:<writer>`).
    Beat(Writer),
    /// The heartbeat's key expired.
    AliveLapses(Writer),
    /// A committed row forgotten (`HDEL`).
    Forget(Writer, Lease),
    /// Redis lost everything (a restart without persistence).
    DataLoss,
    /// The slot set expired whole, as Redis lets it when no script ran for a while
    /// (a Redis that stood still, and then the keys' expiry came before any purge).
    RunExpires,
    /// The bookkeeping fields (`#running`, `#lapsed`, `#sum:<month>`) gone from
    /// `grants`, the reservations left: data of a version before the bookkeeping.
    BookLost,
    /// The clock moves on by this many seconds.
    Forward(u64),
    /// The clock jumps by about `LAPSED_KEEP`, as after a Redis that stood still:
    /// mostly 121 s, past it; else 119 or 120 s, so that a few seconds more reach
    /// the very edge of a lapsed reservation's keep.
    Jump(u64),
}

impl Step {
    /// A step drawn with an eye on the model's data, so that the rarer paths are taken
    /// often: a step is likelier where it does something (turns while somebody waits,
    /// renewals and finishes while slots are held, a seeding while the counter is
    /// missing), and its lease is mostly one it does something to. The model is
    /// deterministic, so the trace's seed alone still fixes every step.
    fn random(rng: &mut Rng, state: &Redis) -> Step {
        let key = &state.key;
        let queued: Vec<Lease> = key.queue.keys().copied().collect();
        let held: Vec<Lease> = key
            .run
            .keys()
            .chain(key.grants.keys())
            .chain(key.lapsed.keys())
            .copied()
            .collect();
        let fresh: Vec<Lease> = (1..=LEASES as Lease)
            .filter(|lease| !queued.contains(lease) && !held.contains(lease))
            .collect();
        let journaled: Vec<Writer> = state.journal.rows.keys().copied().collect();
        let (unseeded, waiting, holding) =
            (key.used.is_none(), !queued.is_empty(), !held.is_empty());
        let weight =
            |when: bool, likely: u64, otherwise: u64| if when { likely } else { otherwise };
        // In the order of the match below.
        let weights = [
            weight(unseeded, 30, 3), // seed
            22,                      // admit
            weight(waiting, 18, 3),  // turn
            weight(waiting, 3, 1),   // leave
            weight(holding, 10, 2),  // finish
            weight(holding, 14, 2),  // renew
            1,                       // usage
            1,                       // occupancy
            2,                       // peek
            1,                       // rate
            4,                       // adopt
            3,                       // beat
            2,                       // alive lapses
            3,                       // forget
            1,                       // data loss
            2,                       // run expires
            1,                       // bookkeeping lost
            14,                      // forward
            1,                       // jump
        ];
        let mut roll = rng.range(0, weights.iter().sum::<u64>() - 1);
        let mut choice = 0;
        while roll >= weights[choice] {
            roll -= weights[choice];
            choice += 1;
        }
        match choice {
            0 => Step::Seed(rng.range(0, 10)),
            1 => Step::Admit(rng.pick(&fresh, Rng::lease)),
            2 => Step::Turn(rng.pick(&queued, Rng::lease)),
            3 => Step::Leave(rng.pick(&queued, Rng::lease)),
            4 => {
                let lease = rng.pick(&held, Rng::lease);
                let tokens = rng.range(0, 20);
                let prompt = rng.range(0, tokens);
                let writer = if rng.range(0, 2) == 0 {
                    None
                } else {
                    Some(rng.writer())
                };
                Step::Finish {
                    lease,
                    tokens,
                    prompt,
                    writer,
                }
            }
            5 => Step::Renew(rng.pick(&held, Rng::lease)),
            6 => Step::Usage,
            7 => Step::Occupancy,
            8 => Step::Peek,
            9 => Step::Rate,
            10 => {
                // Never a writer's own journal: `adopt_orphans` skips it.
                let theirs = rng.pick(&journaled, Rng::writer);
                let ours = (theirs + rng.range(0, 1) as Writer) % WRITERS as Writer + 1;
                Step::Adopt { theirs, ours }
            }
            11 => Step::Beat(rng.writer()),
            12 => Step::AliveLapses(rng.writer()),
            13 => {
                let writer = rng.pick(&journaled, Rng::writer);
                let rows: Vec<Lease> = state
                    .journal
                    .rows
                    .get(&writer)
                    .map(|rows| rows.keys().copied().collect())
                    .unwrap_or_default();
                Step::Forget(writer, rng.pick(&rows, Rng::lease))
            }
            14 => Step::DataLoss,
            15 => Step::RunExpires,
            16 => Step::BookLost,
            17 => Step::Forward(rng.range(0, 3)),
            _ => Step::Jump(if rng.range(0, 3) == 0 {
                LAPSED_KEEP_SECS - rng.range(0, 1)
            } else {
                LAPSED_KEEP_SECS + 1
            }),
        }
    }
}

/// What a trace runs with, drawn from its seed before its steps.
struct Setup {
    seed: u64,
    limits: Limits,
    ttls: Ttls,
    /// The cost of lease `n` at `n - 1`: a request's cost is the same for its admit
    /// and its turns.
    costs: Vec<Cost>,
}

impl Setup {
    fn random(seed: u64, rng: &mut Rng) -> Setup {
        // Mostly no rate: with one, most admissions would be refused on it.
        let rpm = if rng.range(0, 2) > 0 {
            0
        } else {
            rng.range(1, 3)
        };
        let limits = Limits {
            rpm,
            max_concurrent: rng.range(1, 3),
            max_queued: rng.range(0, 2),
            budget: rng.range(0, 60),
        };
        // The gateway's 2 s, or 3 s: on a clock of whole seconds a place of 2 s has
        // never less than half its TTL left, so only 3 s takes turn's refresh.
        let ttls = Ttls {
            lease: rng.range(2, 3) * 1_000_000,
            queue: rng.range(2, 3) * 1_000_000,
        };
        let costs = (0..LEASES)
            .map(|_| Cost {
                prompt: rng.range(0, 8),
                fan_out: rng.range(1, 2),
                max_tokens: rng.range(1, 10),
            })
            .collect();
        Setup {
            seed,
            limits,
            ttls,
            costs,
        }
    }

    fn cost(&self, lease: Lease) -> Cost {
        self.costs[usize::from(lease) - 1]
    }

    fn describe(&self) -> String {
        let mut out = format!(
            "trace seed {} (CONFORMANCE_SEED={0})\n  {:?}\n  {:?}\n",
            self.seed, self.limits, self.ttls
        );
        for (i, cost) in self.costs.iter().enumerate() {
            let _ = writeln!(out, "  r{}: {cost:?}", i + 1);
        }
        out
    }
}

fn lease_name(lease: Lease) -> String {
    format!("r{lease}")
}

fn writer_name(writer: Writer) -> String {
    format!("w{writer}")
}

/// Redis key names under the test's prefix.
struct Names {
    prefix: String,
    rate: String,
    run: String,
    grants: String,
    queue: String,
    qexp: String,
    used: String,
    channel: String,
    writers: String,
    clock: String,
}

impl Names {
    fn new(prefix: &str) -> Names {
        let base = format!("{prefix}:{{{KEY_ID}}}");
        Names {
            prefix: prefix.to_owned(),
            rate: format!("{base}:rate"),
            run: format!("{base}:run"),
            grants: format!("{base}:grants"),
            queue: format!("{base}:queue"),
            qexp: format!("{base}:qexp"),
            used: format!("{base}:used:{MONTH}"),
            channel: format!("{prefix}:wake"),
            writers: format!("{prefix}:writers"),
            clock: format!("{prefix}:clock"),
        }
    }

    fn journal(&self, writer: Writer) -> String {
        format!("{}:unwritten:{}", self.prefix, writer_name(writer))
    }

    fn alive(&self, writer: Writer) -> String {
        format!("{}:alive:{}", self.prefix, writer_name(writer))
    }

    fn writer_ids() -> impl Iterator<Item = Writer> {
        1..=WRITERS as Writer
    }

    /// Every key the protocol may keep (and the clock).
    fn known(&self) -> BTreeSet<String> {
        let mut known: BTreeSet<String> = [
            &self.rate,
            &self.run,
            &self.grants,
            &self.queue,
            &self.qexp,
            &self.used,
            &self.writers,
            &self.clock,
        ]
        .into_iter()
        .cloned()
        .collect();
        for writer in Names::writer_ids() {
            known.insert(self.journal(writer));
            known.insert(self.alive(writer));
        }
        known
    }
}

/// The scripts as the gateway builds them, reading the test's clock.
struct Scripts {
    admit: Script,
    turn: Script,
    leave: Script,
    finish: Script,
    renew: Script,
    usage: Script,
    occupancy: Script,
    peek: Script,
    rate: Script,
    adopt: Script,
}

impl Scripts {
    /// With `finish` as the text of `finish.lua` (the broken test passes another).
    fn new(clock_key: &str, finish: &str) -> Scripts {
        assert_eq!(
            COMMON.matches(TIME_CALL).count(),
            1,
            "common.lua no longer reads the clock exactly once as `{TIME_CALL}`: \
             the conformance test's fake clock must be fitted to the new reading"
        );
        let common = COMMON.replacen(
            TIME_CALL,
            &format!("{{redis.call('GET', '{clock_key}'), '0'}}"),
            1,
        );
        let build = |own: &str| {
            let text = format!("{common}{own}");
            assert!(
                !text.contains("'TIME'") && !text.contains("\"TIME\""),
                "a script reads Redis's clock other than through now_us(): \
                 the conformance test's fake clock does not cover it"
            );
            Script::new(&text)
        };
        assert!(!ADOPT.contains("TIME"), "adopt.lua reads the clock now");
        Scripts {
            admit: build(ADMIT),
            turn: build(TURN),
            leave: build(LEAVE),
            finish: build(finish),
            renew: build(RENEW),
            usage: build(USAGE),
            occupancy: build(OCCUPANCY),
            peek: build(PEEK),
            rate: build(RATE),
            adopt: Script::new(ADOPT),
        }
    }
}

/// Why a test without `TEST_REDIS_URL` fails.
const NO_REDIS: &str = "TEST_REDIS_URL is not set: the conformance test needs a Redis to run \
                        the scripts on (e.g. TEST_REDIS_URL=redis://127.0.0.1:6379)";

/// Deletes every key under the prefix when the test ends, however it ends.
struct Cleanup {
    client: redis::Client,
    prefix: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        // Nothing to do but try: a panic here would hide the test's own.
        if let Ok(mut con) = self.client.get_connection()
            && let Ok(keys) = keys_under(&mut con, &self.prefix)
            && !keys.is_empty()
        {
            let _ = redis::cmd("DEL").arg(keys).exec(&mut con);
        }
    }
}

/// Sets the fake clock to `secs`. The key expires in an hour (real time), so a run
/// killed before its cleanup leaves no clock behind for long.
fn set_clock(con: &mut Connection, key: &str, secs: u64) -> Result<(), String> {
    redis::cmd("SET")
        .arg(key)
        .arg(secs)
        .arg("EX")
        .arg(3600)
        .exec(con)
        .map_err(failed("set the clock"))
}

/// Every key under `prefix` (`SCAN`).
fn keys_under(con: &mut Connection, prefix: &str) -> redis::RedisResult<Vec<String>> {
    let pattern = format!("{prefix}:*");
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(con)?;
        keys.extend(batch);
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

fn failed(what: &str) -> impl FnOnce(redis::RedisError) -> String + '_ {
    move |err| format!("redis, {what}: {err}")
}

/// Runs a model function, a panic (an overflow, say) reported as a divergence.
fn model<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        format!("the model panicked: {message}")
    })
}

/// A script's reply, decoded as `limiter.rs` decodes it: the code first (common.lua's
/// RUNNING 0 … DONE 8), then the values, a missing or negative one read as 0.
fn decode(reply: &[i64]) -> Result<Reply, String> {
    let value = |i: usize| reply.get(i).map_or(0, |&v| u64::try_from(v).unwrap_or(0));
    Ok(match reply.first().copied().unwrap_or(-1) {
        0 => Reply::Running {
            fit: value(1),
            hold: value(2),
        },
        1 => Reply::Queued,
        2 => Reply::RateLimited { wait: value(1) },
        3 => Reply::QueueFull,
        4 => Reply::Budget {
            used: value(1),
            reserved: value(2),
            needed: value(3),
        },
        5 => Reply::Seed,
        6 => Reply::Wait,
        7 => Reply::Gone,
        8 => Reply::Done(value(1), value(2)),
        other => return Err(format!("unknown reply code {other} in {reply:?}")),
    })
}

fn reply_kind(reply: &Reply) -> &'static str {
    match reply {
        Reply::Running { .. } => "running",
        Reply::Queued => "queued",
        Reply::RateLimited { .. } => "rate limited",
        Reply::QueueFull => "queue full",
        Reply::Budget { .. } => "budget",
        Reply::Seed => "seed",
        Reply::Wait => "wait",
        Reply::Gone => "gone",
        Reply::Done(..) => "done",
    }
}

fn parse<T: std::str::FromStr>(text: &str, what: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{what}: cannot read {text:?}"))
}

/// `r<n>` → `n`, exactly (`r01` is not a lease of the test's).
fn lease_of(member: &str) -> Result<Lease, String> {
    member
        .strip_prefix('r')
        .and_then(|n| n.parse::<Lease>().ok())
        .filter(|&n| lease_name(n) == member)
        .ok_or_else(|| format!("not a lease of the test's: {member:?}"))
}

/// A zset score that must be a whole number of µs.
fn micros(score: &str) -> Result<u64, String> {
    let value: f64 = parse(score, "a score")?;
    if !(value >= 0.0 && value.fract() == 0.0 && value < (1u64 << 53) as f64) {
        return Err(format!("a score that is no time in µs: {score:?}"));
    }
    Ok(value as u64)
}

/// `[field, value, …]` (HGETALL, or ZRANGE … WITHSCORES) as pairs.
fn pairs(flat: Vec<String>) -> Result<Vec<(String, String)>, String> {
    if !flat.len().is_multiple_of(2) {
        return Err(format!("an odd field/value list: {flat:?}"));
    }
    let mut flat = flat.into_iter();
    let mut out = Vec::new();
    while let (Some(field), Some(value)) = (flat.next(), flat.next()) {
        out.push((field, value));
    }
    Ok(out)
}

fn lease_zset(flat: Vec<String>) -> Result<BTreeMap<Lease, u64>, String> {
    pairs(flat)?
        .into_iter()
        .map(|(member, score)| Ok((lease_of(&member)?, micros(&score)?)))
        .collect()
}

/// `"YYYY-MM reserved"` (a running reservation) or, with `lapsed`, `"YYYY-MM reserved
/// lapsed_at"`.
fn reservation(value: &str, lapsed: bool) -> Result<(u64, u64), String> {
    let parts: Vec<&str> = value.split(' ').collect();
    let expected = if lapsed { 3 } else { 2 };
    if parts.len() != expected || parts[0] != MONTH {
        return Err(format!("a reservation the test never made: {value:?}"));
    }
    let reserved = parse(parts[1], "reserved tokens")?;
    let at = if lapsed {
        parse(parts[2], "lapsed at")?
    } else {
        0
    };
    Ok((reserved, at))
}

/// A journal row, `"key_id month prompt completion created_at"`, as its total tokens.
fn row_tokens(value: &str) -> Result<u64, String> {
    let parts: Vec<&str> = value.split(' ').collect();
    if parts.len() != 5 || parts[0] != KEY_ID || parts[1] != MONTH {
        return Err(format!("a journal row the test never wrote: {value:?}"));
    }
    let prompt: u64 = parse(parts[2], "prompt tokens")?;
    let completion: u64 = parse(parts[3], "completion tokens")?;
    Ok(prompt + completion)
}

fn journal_rows(flat: Vec<String>) -> Result<BTreeMap<Lease, u64>, String> {
    pairs(flat)?
        .into_iter()
        .map(|(field, value)| Ok((lease_of(&field)?, row_tokens(&value)?)))
        .collect()
}

/// The rate key as compared: an arrival time at or before now is absent (see the
/// module doc).
fn normalised(mut state: Redis, now: u64) -> Redis {
    if state.key.rate.is_some_and(|tat| tat <= now) {
        state.key.rate = None;
    }
    state
}

/// The fields of `model` and `redis` that differ, one a line.
fn differences(model: &Redis, redis: &Redis) -> String {
    let mut out = String::new();
    let mut field = |name: &str, m: &dyn Debug, r: &dyn Debug| {
        let (m, r) = (format!("{m:?}"), format!("{r:?}"));
        if m != r {
            let _ = writeln!(out, "    {name}: model {m}, redis {r}");
        }
    };
    let (m, r) = (&model.key, &redis.key);
    field("rate", &m.rate, &r.rate);
    field("run", &m.run, &r.run);
    field("grants", &m.grants, &r.grants);
    field("lapsed (~)", &m.lapsed, &r.lapsed);
    field("book (#)", &m.book, &r.book);
    field("queue", &m.queue, &r.queue);
    field("qexp", &m.qexp, &r.qexp);
    field("used", &m.used, &r.used);
    let (m, r) = (&model.journal, &redis.journal);
    field("journal rows", &m.rows, &r.rows);
    field("writers", &m.writers, &r.writers);
    field("alive", &m.alive, &r.alive);
    out
}

/// What the data after a step shows that the rarer paths of the scripts need: counted,
/// so that a run says how often it got there.
fn observations(state: &Redis) -> [(&'static str, bool); 5] {
    let key = &state.key;
    [
        ("a lapsed reservation", !key.lapsed.is_empty()),
        (
            "a reservation without its slot",
            key.grants.keys().any(|lease| !key.run.contains_key(lease)),
        ),
        (
            "reservations without bookkeeping",
            key.book.running.is_none() && !(key.grants.is_empty() && key.lapsed.is_empty()),
        ),
        ("two waiting", key.queue.len() >= 2),
        ("journal rows", !state.journal.rows.is_empty()),
    ]
}

#[derive(Default)]
struct Stats {
    traces: usize,
    steps: usize,
    /// How often each script gave each reply (`admit: running`), and how often each
    /// other step ran.
    seen: BTreeMap<String, usize>,
}

struct Harness {
    con: Connection,
    names: Names,
    scripts: Scripts,
    /// The fake clock, whole seconds.
    clock: u64,
    // Last: the connection above is closed before the keys are deleted.
    _cleanup: Cleanup,
}

impl Harness {
    /// A harness on the Redis at `url` under a fresh prefix, `finish` as the text of
    /// `finish.lua`.
    fn new(url: &str, tag: &str, finish: &str) -> Result<Harness, String> {
        let client = redis::Client::open(url).map_err(failed("the URL"))?;
        let mut con = client.get_connection().map_err(failed("connect"))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| format!("the system clock: {e}"))?;
        let prefix = format!("fgmodel-{}-{}-{tag}", std::process::id(), nanos.as_nanos());
        let names = Names::new(&prefix);
        // The next whole second: never behind real time.
        let clock = nanos.as_secs() + 1;
        set_clock(&mut con, &names.clock, clock)?;
        Ok(Harness {
            con,
            scripts: Scripts::new(&names.clock, finish),
            names,
            clock,
            _cleanup: Cleanup { client, prefix },
        })
    }

    fn now(&self) -> u64 {
        self.clock * 1_000_000
    }

    fn advance(&mut self, secs: u64) -> Result<(), String> {
        self.clock += secs;
        set_clock(&mut self.con, &self.names.clock, self.clock)
    }

    /// Every key of the prefix deleted but the clock.
    fn wipe(&mut self) -> Result<(), String> {
        let keys: Vec<String> = keys_under(&mut self.con, &self.names.prefix)
            .map_err(failed("scan"))?
            .into_iter()
            .filter(|key| *key != self.names.clock)
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        redis::cmd("DEL")
            .arg(keys)
            .exec(&mut self.con)
            .map_err(failed("delete"))
    }

    /// Keys under the prefix that the protocol does not know.
    fn strangers(&mut self) -> Result<Vec<String>, String> {
        let known = self.names.known();
        Ok(keys_under(&mut self.con, &self.names.prefix)
            .map_err(failed("scan"))?
            .into_iter()
            .filter(|key| !known.contains(key))
            .collect())
    }

    /// The data under the prefix, read back into the model's form.
    fn read_back(&mut self) -> Result<Redis, String> {
        let n = &self.names;
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(&n.rate);
        for zset in [&n.run, &n.queue, &n.qexp] {
            pipe.cmd("ZRANGE")
                .arg(zset)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES");
        }
        pipe.cmd("HGETALL").arg(&n.grants);
        pipe.cmd("GET").arg(&n.used);
        pipe.cmd("SMEMBERS").arg(&n.writers);
        for writer in Names::writer_ids() {
            pipe.cmd("HGETALL").arg(n.journal(writer));
            pipe.cmd("EXISTS").arg(n.alive(writer));
        }
        let values: Vec<Value> = pipe.query(&mut self.con).map_err(failed("read back"))?;
        let mut values = values.into_iter();
        let mut next = |what: &str| values.next().ok_or_else(|| format!("no reply for {what}"));
        fn typed<T: redis::FromRedisValue>(value: Value, what: &str) -> Result<T, String> {
            redis::from_redis_value(value).map_err(|e| format!("{what}: {e}"))
        }

        let mut key = Key {
            rate: typed::<Option<String>>(next("rate")?, "rate")?
                .map(|tat| parse(&tat, "rate"))
                .transpose()?,
            run: lease_zset(typed(next("run")?, "run")?)?,
            queue: lease_zset(typed(next("queue")?, "queue")?)?,
            qexp: lease_zset(typed(next("qexp")?, "qexp")?)?,
            ..Key::default()
        };
        let sum_field = format!("#sum:{MONTH}");
        for (field, value) in pairs(typed(next("grants")?, "grants")?)? {
            match field.as_str() {
                "#running" => key.book.running = Some(parse(&value, "#running")?),
                "#lapsed" => key.book.lapsed = Some(parse(&value, "#lapsed")?),
                f if f == sum_field => key.book.sum = Some(parse(&value, &sum_field)?),
                f => match f.strip_prefix('~') {
                    Some(lease) => {
                        key.lapsed
                            .insert(lease_of(lease)?, reservation(&value, true)?);
                    }
                    None => {
                        key.grants
                            .insert(lease_of(f)?, reservation(&value, false)?.0);
                    }
                },
            }
        }
        key.used = typed::<Option<String>>(next("used")?, "used")?
            .map(|used| parse(&used, "used"))
            .transpose()?;

        let mut journal = Journal::default();
        for writer in typed::<Vec<String>>(next("writers")?, "writers")? {
            journal.writers.insert(
                writer
                    .strip_prefix('w')
                    .and_then(|n| n.parse::<Writer>().ok())
                    .filter(|&n| writer_name(n) == writer)
                    .ok_or_else(|| format!("not a writer of the test's: {writer:?}"))?,
            );
        }
        for writer in Names::writer_ids() {
            let rows = journal_rows(typed(next("journal")?, "journal")?)?;
            if !rows.is_empty() {
                journal.rows.insert(writer, rows);
            }
            if typed::<bool>(next("alive")?, "alive")? {
                journal.alive.insert(writer);
            }
        }
        Ok(Redis { key, journal })
    }

    /// Runs a script that replies with codes and values.
    fn eval(
        con: &mut Connection,
        call: &ScriptInvocation<'_>,
        what: &str,
    ) -> Result<Reply, String> {
        let reply: Vec<i64> = call.invoke(con).map_err(failed(what))?;
        decode(&reply)
    }

    /// The arguments admit and turn end with (`start_args` in limiter.rs), and the
    /// queue TTL after them.
    fn start_args(&self, call: &mut ScriptInvocation<'_>, setup: &Setup, lease: Lease) {
        let cost = setup.cost(lease);
        call.arg(setup.limits.budget)
            .arg(cost.prompt)
            .arg(cost.fan_out)
            .arg(cost.max_tokens)
            .arg(lease_name(lease))
            .arg(MONTH)
            .arg(setup.ttls.lease / 1000)
            .arg(&self.names.channel)
            .arg(KEY_ID)
            .arg(setup.ttls.queue / 1000);
    }

    /// Runs `step` on Redis and on `state`, and compares the replies. Returns what to
    /// count it as.
    fn step(&mut self, step: Step, state: &mut Redis, setup: &Setup) -> Result<String, String> {
        let now = self.now();
        let (limits, ttls) = (&setup.limits, &setup.ttls);
        let n = &self.names;
        let s = &self.scripts;
        let (name, got, want) = match step {
            Step::Admit(lease) => {
                let mut call = s.admit.prepare_invoke();
                call.key(&n.rate)
                    .key(&n.run)
                    .key(&n.grants)
                    .key(&n.queue)
                    .key(&n.qexp)
                    .key(&n.used)
                    .arg(limits.rpm)
                    .arg(limits.max_concurrent)
                    .arg(limits.max_queued);
                self.start_args(&mut call, setup, lease);
                let cost = setup.cost(lease);
                let want = model(|| state.key.admit(lease, limits, &cost, now, ttls))?;
                ("admit", Self::eval(&mut self.con, &call, "admit")?, want)
            }
            Step::Turn(lease) => {
                let mut call = s.turn.prepare_invoke();
                call.key(&n.run)
                    .key(&n.grants)
                    .key(&n.queue)
                    .key(&n.qexp)
                    .key(&n.used)
                    .arg(limits.max_concurrent);
                self.start_args(&mut call, setup, lease);
                let cost = setup.cost(lease);
                let want = model(|| state.key.turn(lease, limits, &cost, now, ttls))?;
                ("turn", Self::eval(&mut self.con, &call, "turn")?, want)
            }
            Step::Leave(lease) => {
                let mut call = s.leave.prepare_invoke();
                call.key(&n.run)
                    .key(&n.grants)
                    .key(&n.queue)
                    .key(&n.qexp)
                    .arg(lease_name(lease))
                    .arg(&n.channel)
                    .arg(KEY_ID);
                let want = model(|| state.key.leave(lease, now))?;
                ("leave", Self::eval(&mut self.con, &call, "leave")?, want)
            }
            Step::Finish {
                lease,
                tokens,
                prompt,
                writer,
            } => {
                let mut call = s.finish.prepare_invoke();
                call.key(&n.run)
                    .key(&n.grants)
                    .key(&n.queue)
                    .key(&n.qexp)
                    .key(&n.used)
                    .arg(lease_name(lease))
                    .arg(tokens)
                    .arg(MONTH)
                    .arg(&n.channel)
                    .arg(KEY_ID);
                if let Some(writer) = writer {
                    // `journal::encode`: key_id month prompt completion created_at.
                    let row = format!(
                        "{KEY_ID} {MONTH} {prompt} {} {}",
                        tokens - prompt,
                        self.clock
                    );
                    // The row's request id is the lease's (a job run's would be its
                    // job's: the model's rows are ordinary requests').
                    call.key(n.journal(writer))
                        .key(&n.writers)
                        .arg(writer_name(writer))
                        .arg(row)
                        .arg(lease_name(lease));
                }
                let want = model(|| state.finish(lease, tokens, writer, now))?;
                ("finish", Self::eval(&mut self.con, &call, "finish")?, want)
            }
            Step::Renew(lease) => {
                let mut call = s.renew.prepare_invoke();
                call.key(&n.run)
                    .key(&n.grants)
                    .key(&n.queue)
                    .key(&n.qexp)
                    .arg(lease_name(lease))
                    .arg(ttls.lease / 1000)
                    .arg(&n.channel)
                    .arg(KEY_ID);
                let want = model(|| state.key.renew(lease, now, ttls))?;
                ("renew", Self::eval(&mut self.con, &call, "renew")?, want)
            }
            Step::Usage => {
                let mut call = s.usage.prepare_invoke();
                call.key(&n.run)
                    .key(&n.grants)
                    .key(&n.queue)
                    .key(&n.qexp)
                    .key(&n.used)
                    .arg(MONTH)
                    .arg(&n.channel)
                    .arg(KEY_ID);
                let want = model(|| state.key.usage(now))?;
                ("usage", Self::eval(&mut self.con, &call, "usage")?, want)
            }
            Step::Occupancy => {
                let mut call = s.occupancy.prepare_invoke();
                call.key(&n.run)
                    .key(&n.grants)
                    .key(&n.queue)
                    .key(&n.qexp)
                    .arg(&n.channel)
                    .arg(KEY_ID);
                let want = model(|| state.key.occupancy(now))?;
                (
                    "occupancy",
                    Self::eval(&mut self.con, &call, "occupancy")?,
                    want,
                )
            }
            Step::Peek => {
                let mut call = s.peek.prepare_invoke();
                call.key(&n.rate)
                    .key(&n.run)
                    .key(&n.grants)
                    .key(&n.queue)
                    .key(&n.qexp)
                    .arg(limits.rpm)
                    .arg(limits.max_concurrent)
                    .arg(limits.max_queued)
                    .arg(&n.channel)
                    .arg(KEY_ID);
                let want = model(|| state.key.peek(limits, now))?;
                ("peek", Self::eval(&mut self.con, &call, "peek")?, want)
            }
            Step::Rate => {
                let mut call = s.rate.prepare_invoke();
                // `count_start` passes at least 1; the model's `rate` takes care of that.
                call.key(&n.rate).arg(limits.rpm.max(1));
                let want = model(|| state.key.rate(limits.rpm, now))?;
                ("rate", Self::eval(&mut self.con, &call, "rate")?, want)
            }
            Step::Adopt { theirs, ours } => {
                let mut call = s.adopt.prepare_invoke();
                call.key(n.journal(theirs))
                    .key(n.journal(ours))
                    .key(&n.writers)
                    .key(n.alive(theirs))
                    .arg(writer_name(theirs))
                    .arg(writer_name(ours))
                    .arg(ADOPT_BATCH);
                let entries: Vec<String> = call.invoke(&mut self.con).map_err(failed("adopt"))?;
                // The rows in request-id order: HSCAN's order is no part of the
                // contract (each row is recorded by itself).
                let mut got = pairs(entries)?
                    .into_iter()
                    .map(|(field, row)| Ok((lease_of(&field)?, row_tokens(&row)?)))
                    .collect::<Result<Vec<(Lease, u64)>, String>>()?;
                got.sort_unstable();
                let mut want = model(|| state.adopt(theirs, ours))?;
                want.sort_unstable();
                if got != want {
                    return Err(format!("adopt's rows: model {want:?}, redis {got:?}"));
                }
                return Ok(format!(
                    "adopt: {}",
                    if got.is_empty() { "none" } else { "rows" }
                ));
            }
            Step::Seed(value) => {
                redis::cmd("SET")
                    .arg(&n.used)
                    .arg(value)
                    .arg("NX")
                    .arg("EX")
                    .arg(SEED_TTL_SECS)
                    .exec(&mut self.con)
                    .map_err(failed("seed"))?;
                model(|| state.key.seed(value))?;
                return Ok("(seed)".to_owned());
            }
            Step::Beat(writer) => {
                redis::cmd("SET")
                    .arg(n.alive(writer))
                    .arg(1)
                    .exec(&mut self.con)
                    .map_err(failed("beat"))?;
                model(|| state.beat(writer))?;
                return Ok("(beat)".to_owned());
            }
            Step::AliveLapses(writer) => {
                redis::cmd("DEL")
                    .arg(n.alive(writer))
                    .exec(&mut self.con)
                    .map_err(failed("alive lapses"))?;
                state.journal.alive.remove(&writer);
                return Ok("(alive lapses)".to_owned());
            }
            Step::Forget(writer, lease) => {
                redis::cmd("HDEL")
                    .arg(n.journal(writer))
                    .arg(lease_name(lease))
                    .exec(&mut self.con)
                    .map_err(failed("forget"))?;
                model(|| state.forget(writer, lease))?;
                return Ok("(forget)".to_owned());
            }
            Step::DataLoss => {
                self.wipe()?;
                *state = Redis::default();
                return Ok("(data loss)".to_owned());
            }
            Step::RunExpires => {
                redis::cmd("DEL")
                    .arg(&n.run)
                    .exec(&mut self.con)
                    .map_err(failed("run expires"))?;
                state.key.run.clear();
                return Ok("(run expires)".to_owned());
            }
            Step::BookLost => {
                redis::cmd("HDEL")
                    .arg(&n.grants)
                    .arg("#running")
                    .arg("#lapsed")
                    .arg(format!("#sum:{MONTH}"))
                    .exec(&mut self.con)
                    .map_err(failed("bookkeeping lost"))?;
                state.key.book = Book::default();
                return Ok("(bookkeeping lost)".to_owned());
            }
            Step::Forward(secs) => {
                self.advance(secs)?;
                return Ok("(forward)".to_owned());
            }
            Step::Jump(secs) => {
                self.advance(secs)?;
                return Ok("(jump)".to_owned());
            }
        };
        if got != want {
            return Err(format!("{name}'s reply: model {want:?}, redis {got:?}"));
        }
        Ok(match got {
            // Whether a finish settled, a renew found its lease.
            Reply::Done(found, _) if matches!(name, "finish" | "renew") => {
                format!("{name}: done {found}")
            }
            _ => format!("{name}: {}", reply_kind(&got)),
        })
    }

    /// One trace of `steps` steps from `seed`, on wiped data; a divergence is described
    /// with the trace so far.
    fn trace(&mut self, seed: u64, steps: usize, stats: &mut Stats) -> Result<(), String> {
        let mut rng = Rng(seed);
        let setup = Setup::random(seed, &mut rng);
        self.wipe()?;
        let start = self.clock;
        let mut state = Redis::default();
        let mut log = setup.describe();
        let diverged = |log: &str, what: String| format!("{log}diverged: {what}");
        for i in 0..steps {
            let step = Step::random(&mut rng, &state);
            let _ = writeln!(log, "  {i:>2} t+{:<4} {step:?}", self.clock - start);
            let seen = self
                .step(step, &mut state, &setup)
                .map_err(|what| diverged(&log, what))?;
            *stats.seen.entry(seen).or_default() += 1;
            for (what, now) in observations(&state) {
                if now {
                    *stats.seen.entry(format!("state: {what}")).or_default() += 1;
                }
            }
            stats.steps += 1;
            let now = self.now();
            let redis = self
                .read_back()
                .map_err(|what| diverged(&log, format!("the data read back: {what}")))?;
            let (model, redis) = (normalised(state.clone(), now), normalised(redis, now));
            if model != redis {
                return Err(diverged(
                    &log,
                    format!("the data after the step\n{}", differences(&model, &redis)),
                ));
            }
        }
        let strangers = self.strangers()?;
        if !strangers.is_empty() {
            return Err(diverged(
                &log,
                format!("keys the protocol does not know: {strangers:?}"),
            ));
        }
        stats.traces += 1;
        Ok(())
    }
}

/// The traces' seeds: `CONFORMANCE_SEED` alone, or `CONFORMANCE_TRACES` (default
/// [`TRACES`]) drawn from [`MASTER_SEED`].
fn seeds_from_env() -> Result<Vec<u64>, String> {
    if let Ok(seed) = std::env::var("CONFORMANCE_SEED") {
        return Ok(vec![parse(&seed, "CONFORMANCE_SEED (a trace's seed)")?]);
    }
    let traces = match std::env::var("CONFORMANCE_TRACES") {
        Ok(n) => parse(&n, "CONFORMANCE_TRACES (a number of traces)")?,
        Err(_) => TRACES,
    };
    Ok(default_seeds(traces))
}

fn default_seeds(traces: usize) -> Vec<u64> {
    let mut master = Rng(MASTER_SEED);
    (0..traces).map(|_| master.next()).collect()
}

/// Runs the traces of `seeds`; the first divergence ends the run.
fn check(harness: &mut Harness, seeds: &[u64]) -> Result<(Stats, Duration), String> {
    let began = Instant::now();
    let mut stats = Stats::default();
    for &seed in seeds {
        harness.trace(seed, STEPS, &mut stats)?;
    }
    Ok((stats, began.elapsed()))
}

#[test]
#[ignore = "needs Redis: TEST_REDIS_URL"]
fn the_model_does_what_the_scripts_do() {
    let url = std::env::var("TEST_REDIS_URL").expect(NO_REDIS);
    let seeds = seeds_from_env().expect("the CONFORMANCE_* variables are readable");
    let mut harness =
        Harness::new(&url, "conform", FINISH).expect("a harness on the Redis at TEST_REDIS_URL");
    match check(&mut harness, &seeds) {
        Ok((stats, took)) => {
            println!(
                "{} traces, {} steps, {:.1} s; steps seen:",
                stats.traces,
                stats.steps,
                took.as_secs_f64()
            );
            for (what, count) in &stats.seen {
                println!("  {what:<24} {count}");
            }
        }
        Err(divergence) => panic!("the model and the scripts diverge:\n{divergence}"),
    }
}

/// Evidence the comparison has teeth: a `finish.lua` that settles the reservation but
/// keeps the slot is found out.
#[test]
#[ignore = "needs Redis: TEST_REDIS_URL"]
fn a_broken_script_is_caught() {
    let url = std::env::var("TEST_REDIS_URL").expect(NO_REDIS);
    assert_eq!(
        FINISH.matches(FINISH_RELEASE).count(),
        1,
        "finish.lua releases the slot on one line `{}`",
        FINISH_RELEASE.trim_end()
    );
    let broken = FINISH.replacen(FINISH_RELEASE, "", 1);
    let mut harness =
        Harness::new(&url, "broken", &broken).expect("a harness on the Redis at TEST_REDIS_URL");
    let divergence = check(&mut harness, &default_seeds(TRACES))
        .err()
        .expect("a finish.lua that keeps the slot diverges from the model");
    println!("found, as it should be:\n{divergence}");
}
