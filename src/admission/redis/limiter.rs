//! [`RedisLimiter`], the shared limiter: the counters live in Redis, so every gateway
//! replica enforces one set of limits per key.
//!
//! Every decision is one Lua script (EVALSHA; loaded again by itself after a Redis
//! restart), so it is atomic across replicas and costs one round trip; "now" is Redis's
//! own clock (`TIME`), shared by all replicas. The scripts run on a connection of their
//! own per runtime ([`resp`]), the rest (seeding, the journal, the subscription) on the
//! `redis` crate's; `connection.rs` keeps both kinds, the subscription is `wakeups.rs`'s.
//!
//! # Data layout
//!
//! All under the configured prefix `P`; the data of one API key carries the hash tag
//! `{key_id}`, so it would live in one cluster slot:
//!
//! | key | type | content |
//! | --- | --- | --- |
//! | `P:{id}:run` | zset | running leases → lease expiry (µs, Redis clock) |
//! | `P:{id}:grants` | hash | running lease → `"YYYY-MM reserved"` (its budget reservation); `~lease` → `"YYYY-MM reserved lapsed_at"` (a lapsed slot's); the bookkeeping beside them: `#running`, `#lapsed` (how many of each) and `#sum:YYYY-MM` (their tokens in that month) |
//! | `P:{id}:queue` | zset | waiting leases → ticket (arrival order) |
//! | `P:{id}:qexp` | zset | waiting leases → lease expiry (µs) |
//! | `P:{id}:rate` | string | GCRA theoretical arrival time (µs); expires when idle |
//! | `P:{id}:used:YYYY-MM` | string | used tokens of the month; seeded from the ledger |
//! | `P:service:<model>` | hash | key id → the service all replicas gave the key on the model's nodes, in weighted tokens over its share (the fair fleet queue's, exchanged every 250 ms; expires after an hour untouched) |
//!
//! Settled rows wait in a journal (`P:unwritten:<writer>`, see [`journal`]) until the
//! ledger has them; those keys are shared by all API keys, so the layout is not one
//! for Redis Cluster.
//!
//! Wake-ups go over the pub/sub channel `P:wake` (payload: the key id), published when a
//! slot or queue place frees while somebody waits in the key's queue; each limiter holds
//! one subscription and wakes its local waiters of that key (`wakeups.rs`).
//!
//! # Leases
//!
//! Every running slot expires [`RedisLimiterOptions::lease_ttl`] (2 s by default) after
//! it was taken or last renewed, every queue place
//! [`RedisLimiterOptions::queue_ttl`] (2 s) after its waiter last checked its turn;
//! every script first purges what has expired, so the slots and queue places of a
//! crashed replica come back within seconds by themselves, and a dead waiter at the head
//! of a queue blocks nobody for longer. The gateway calls [`Limiter::renew`] for each
//! live request at least every third of the lease (one task for all of them, see
//! [`renewals`](crate::admission::renewals)); a waiter inside [`Limiter::wait_turn`] checks
//! (and so keeps its place) at least every quarter of the queue TTL.
//!
//! A lapsed slot's reservation is kept aside (`'~'..lease` in `grants`) for two more
//! minutes: it still counts against the budget, a late `finish` still settles it into
//! the used counter, and a late `renew` takes the slot back — so a Redis that stood
//! still past the TTL (its clock jumps on resume) loses no usage and lets no budget be
//! spent twice. A crashed replica's reservations come back after those two minutes.
//!
//! The budget check needs the month's reserved tokens. They are kept as a sum beside
//! the reservations, changed with each of them, so an admission costs the same however
//! many requests of the key are running (reading every reservation cost ~1.5 µs of
//! Redis time each). The reservations are read and the bookkeeping written anew only
//! when it shows something to look at: lapsed reservations (to drop in time), or a
//! count of running ones that differs from the running slots (a slot set that expired
//! whole, or bookkeeping missing or wrong).
//! The lease sets themselves expire no sooner than 1 s after their last lease (`grants`
//! two minutes after), the rate key when it no longer limits, and the used counters
//! [`COUNTER_TTL_PAST_MONTH`] after their month ends. An expiry that must move is moved
//! 10 s further than it must, so a busy key's is written about once every 10 s rather
//! than with every admission.
//!
//! # Cost
//!
//! An admission and its settlement each run one script; on the common path (nobody
//! queued, limits not reached) they make 12 and 9 calls inside Redis, which cost about
//! 2.5 µs each on a small VM whatever the command: the scripts read only what they
//! decide on, write the bookkeeping in one `HSET`, look for lapsed queue places and
//! publish wake-ups only while somebody waits, and settle without the clock when nobody
//! does.
//!
//! # Failures
//!
//! Every Redis call is bounded (connect 1 s, response 500 ms by default); any failure
//! refuses the admission with [`Denial::Unavailable`] (budgets fail closed). The limiter
//! connects lazily and never fails to construct while Redis is down; it reconnects by
//! itself on the next call once Redis is back.
//!
//! # Guarantees
//!
//! What this protocol keeps (budget, slots, queue order, nothing lost), with its
//! exceptions and their bounds — a slot over `max_concurrent` after a stall longer than
//! a lease, usage the counter cannot see after Redis lost its data, rows lost with a
//! killed replica — is stated in `docs/reliability.md` ("The admission protocol,
//! model-checked") and checked over every interleaving by `model/admission`, whose
//! conformance test holds its copy of these scripts to them. A change to a script that
//! changes what it does must change `model/admission/src/scripts.rs` too.

use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use super::connection::{Connections, InvalidRedisUrl};
use super::journal;
use super::options::RedisLimiterOptions;
use super::wakeups::Wakeups;
use crate::admission::{
    Admitted, Cost, Denial, Grant, KeyLimits, Lease, Limiter, Month, QUEUE_FULL_RETRY_AFTER,
    QUEUE_PLACE_GONE, Usage, UsageSource,
};
use crate::store::UsageRow;
use crate::wire::resp;

/// How long the reservation of a lapsed slot keeps counting (`LAPSED_KEEP_US` in
/// `common.lua`, which must say the same).
pub const LAPSED_KEEP: Duration = Duration::from_secs(120);
/// How long a used counter lives past the end of its month.
pub const COUNTER_TTL_PAST_MONTH: Duration = Duration::from_secs(40 * 24 * 3600);
/// Seeding attempts per call before giving up (a counter vanishing again at once).
const MAX_SEEDS: u32 = 3;
/// Largest number passed to the scripts: Lua numbers are doubles, exact up to 2^53.
const LUA_MAX: u64 = 1 << 53;

// Reply codes, as in common.lua.
const RUNNING: i64 = 0;
const QUEUED: i64 = 1;
const RATE_LIMITED: i64 = 2;
const QUEUE_FULL: i64 = 3;
const BUDGET: i64 = 4;
const SEED: i64 = 5;
const WAIT: i64 = 6;
const GONE: i64 = 7;
const DONE: i64 = 8;

macro_rules! script {
    ($file:literal) => {
        resp::Script::new(concat!(include_str!("common.lua"), include_str!($file)))
    };
}

pub struct RedisLimiter {
    /// The scripts run on these, and so do the journal's steps (`journal_store.rs`).
    pub(super) connections: Connections,
    prefix: String,
    channel: String,
    source: Arc<dyn UsageSource>,
    options: RedisLimiterOptions,
    scripts: Scripts,
    wakeups: Wakeups,
    /// See [`RedisLimiter::keys`].
    names: Mutex<FxHashMap<i64, Arc<Keys>>>,
    /// Where `finish.lua` journals a settled row, and `journal_store.rs` looks after it.
    pub(super) journal: journal::JournalKeys,
}

struct Scripts {
    admit: resp::Script,
    turn: resp::Script,
    leave: resp::Script,
    finish: resp::Script,
    renew: resp::Script,
    usage: resp::Script,
    occupancy: resp::Script,
    peek: resp::Script,
    rate: resp::Script,
}

/// Redis key names of one API key.
struct Keys {
    run: String,
    grants: String,
    queue: String,
    qexp: String,
    rate: String,
    id: String,
}

enum Turn {
    Started(Grant),
    Wait,
    Seed,
}

impl RedisLimiter {
    /// A limiter on the Redis at `url`, with its keys under `key_prefix`, reading usage it
    /// has not counted from `source`. Does not connect: fails only on a malformed URL.
    pub fn connect(
        url: &str,
        key_prefix: &str,
        source: Arc<dyn UsageSource>,
    ) -> Result<Self, InvalidRedisUrl> {
        Self::connect_with(url, key_prefix, source, RedisLimiterOptions::default())
    }

    /// [`RedisLimiter::connect`] with explicit options.
    pub fn connect_with(
        url: &str,
        key_prefix: &str,
        source: Arc<dyn UsageSource>,
        options: RedisLimiterOptions,
    ) -> Result<Self, InvalidRedisUrl> {
        let connections = Connections::new(url, options)?;
        let channel = format!("{key_prefix}:wake");
        Ok(Self {
            wakeups: Wakeups::new(connections.client().clone(), channel.clone(), options),
            connections,
            prefix: key_prefix.to_owned(),
            channel,
            source,
            options,
            scripts: Scripts {
                admit: script!("admit.lua"),
                turn: script!("turn.lua"),
                leave: script!("leave.lua"),
                finish: script!("finish.lua"),
                renew: script!("renew.lua"),
                usage: script!("usage.lua"),
                occupancy: script!("occupancy.lua"),
                peek: script!("peek.lua"),
                rate: script!("rate.lua"),
            },
            names: Mutex::new(FxHashMap::default()),
            journal: journal::JournalKeys::new(key_prefix),
        })
    }

    /// Refuses a node of a Redis Cluster (`cluster_enabled:1` in `INFO cluster`): the
    /// journal and the wake-up channel are shared by every API key, so they cannot live
    /// in one hash slot, and a script that spans slots fails. Called at start; a Redis
    /// that cannot be asked then (the limiter connects lazily) passes, and a cluster
    /// node found later refuses the scripts, which fails closed.
    pub async fn refuse_cluster(&self) -> Result<(), RedisClusterRefused> {
        let info = self
            .connections
            .call("INFO cluster", |mut connection| async move {
                ::redis::cmd("INFO")
                    .arg("cluster")
                    .query_async::<String>(&mut connection)
                    .await
            })
            .await;
        match info {
            Ok(text) if text.lines().any(|l| l.trim() == "cluster_enabled:1") => {
                Err(RedisClusterRefused)
            }
            _ => Ok(()),
        }
    }

    /// The Redis key names of `key`, made on its first use: formatting them took ~4k
    /// instructions, twice a request. Only keys that passed authentication get here,
    /// so the map holds at most one entry per key in the store.
    fn keys(&self, key: i64) -> Arc<Keys> {
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        let keys = names.entry(key).or_insert_with(|| {
            let base = format!("{}:{{{key}}}", self.prefix);
            Arc::new(Keys {
                run: format!("{base}:run"),
                grants: format!("{base}:grants"),
                queue: format!("{base}:queue"),
                qexp: format!("{base}:qexp"),
                rate: format!("{base}:rate"),
                id: key.to_string(),
            })
        });
        Arc::clone(keys)
    }

    /// The key of the used-tokens counter of `key` for `month`.
    pub fn counter_key(&self, key: i64, month: Month) -> String {
        format!("{}:{{{key}}}:used:{month}", self.prefix)
    }
    /// Initialises a missing used counter from the ledger (never overwriting one that
    /// another replica set meanwhile).
    async fn seed(&self, key: i64, month: Month) -> Result<(), Denial> {
        let recorded = self
            .source
            .month_usage(key, month)
            .await
            .map_err(|e| Denial::Unavailable(format!("usage ledger: {e}")))?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let month_end = u64::try_from(month.next_start_unix()).unwrap_or(0);
        // (A month ends within 31 days; the cap only guards against a nonsense month.)
        let ttl =
            month_end.saturating_sub(now).min(31 * 24 * 3600) + COUNTER_TTL_PAST_MONTH.as_secs();
        let mut set = ::redis::cmd("SET");
        set.arg(self.counter_key(key, month))
            .arg(recorded.min(LUA_MAX))
            .arg("NX")
            .arg("EX")
            .arg(ttl);
        self.connections
            .call("seed", |mut connection| async move {
                set.query_async::<::redis::Value>(&mut connection).await
            })
            .await?;
        Ok(())
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.options.lease_ttl.as_millis())
            .unwrap_or(u64::MAX)
            .clamp(1, LUA_MAX / 1000)
    }

    fn queue_ttl_ms(&self) -> u64 {
        u64::try_from(self.options.queue_ttl.as_millis())
            .unwrap_or(u64::MAX)
            .clamp(1, LUA_MAX / 1000)
    }

    /// The arguments both starting scripts (admit, turn) end with: the budget, the cost,
    /// the lease and where to announce a change.
    fn start_args(
        &self,
        invocation: &mut resp::ScriptCall<'_>,
        k: &Keys,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
        month: Month,
    ) {
        invocation
            .arg(limits.monthly_budget.min(LUA_MAX))
            .arg(cost.prompt_tokens.min(LUA_MAX))
            .arg(cost.fan_out.min(LUA_MAX))
            .arg(cost.max_tokens.min(LUA_MAX))
            .arg(lease)
            .arg(month.to_string())
            .arg(self.ttl_ms())
            .arg(&self.channel)
            .arg(&k.id);
    }

    async fn try_turn(
        &self,
        key: i64,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
        month: Month,
    ) -> Result<Turn, Denial> {
        let k = self.keys(key);
        let mut invocation = self.scripts.turn.call();
        invocation
            .key(&k.run)
            .key(&k.grants)
            .key(&k.queue)
            .key(&k.qexp)
            .key(self.counter_key(key, month))
            .arg(limits.max_concurrent);
        self.start_args(&mut invocation, &k, limits, cost, lease, month);
        invocation.arg(self.queue_ttl_ms());
        let reply = self.connections.invoke("wait_turn", &invocation).await?;
        match code(&reply) {
            WAIT => Ok(Turn::Wait),
            SEED => Ok(Turn::Seed),
            GONE => Err(Denial::Unavailable(QUEUE_PLACE_GONE.to_owned())),
            _ => start_reply(&reply, limits, month).map(Turn::Started),
        }
    }

    /// `finish.lua`: releases the slot and settles the reservation, journaling `row`
    /// (when given and it used tokens) under its request id until the ledger reports
    /// that id committed.
    async fn release(
        &self,
        key: i64,
        lease: &Lease,
        grant: &Grant,
        used_tokens: u64,
        row: Option<&UsageRow>,
    ) -> Result<(), Denial> {
        let k = self.keys(key);
        let mut invocation = self.scripts.finish.call();
        invocation
            .key(&k.run)
            .key(&k.grants)
            .key(&k.queue)
            .key(&k.qexp)
            .key(self.counter_key(key, grant.month))
            .arg(lease)
            .arg(used_tokens.min(LUA_MAX))
            .arg(grant.month.to_string())
            .arg(&self.channel)
            .arg(&k.id);
        if let Some(row) = row {
            invocation
                .key(&self.journal.own)
                .key(&self.journal.writers)
                .arg(&self.journal.writer)
                .arg(journal::encode(row))
                .arg(&row.request_id);
        }
        let reply = self.connections.invoke("finish", &invocation).await?;
        done(&reply)
    }
}

#[async_trait]
impl Limiter for RedisLimiter {
    /// A third of the lease: two renewals may fail before a live request loses its slot.
    fn lease_renewal(&self) -> Option<Duration> {
        Some(self.options.lease_ttl / 3)
    }

    async fn admit(
        &self,
        key: i64,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
    ) -> Result<Admitted, Denial> {
        let month = Month::now();
        let k = self.keys(key);
        for _ in 0..=MAX_SEEDS {
            let mut invocation = self.scripts.admit.call();
            invocation
                .key(&k.rate)
                .key(&k.run)
                .key(&k.grants)
                .key(&k.queue)
                .key(&k.qexp)
                .key(self.counter_key(key, month))
                .arg(limits.requests_per_minute)
                .arg(limits.max_concurrent)
                .arg(limits.max_queued);
            self.start_args(&mut invocation, &k, limits, cost, lease, month);
            invocation.arg(self.queue_ttl_ms());
            let reply = self.connections.invoke("admit", &invocation).await?;
            match code(&reply) {
                SEED => self.seed(key, month).await?,
                QUEUED => return Ok(Admitted::Queued),
                RATE_LIMITED | QUEUE_FULL => return Err(refusal(&reply)),
                _ => return start_reply(&reply, limits, month).map(Admitted::Running),
            }
        }
        Err(seed_failed())
    }

    async fn peek(&self, key: i64, limits: &KeyLimits) -> Result<(), Denial> {
        let k = self.keys(key);
        let reply = self
            .connections
            .invoke(
                "peek",
                self.scripts
                    .peek
                    .call()
                    .key(&k.rate)
                    .key(&k.run)
                    .key(&k.grants)
                    .key(&k.queue)
                    .key(&k.qexp)
                    .arg(limits.requests_per_minute)
                    .arg(limits.max_concurrent)
                    .arg(limits.max_queued)
                    .arg(&self.channel)
                    .arg(&k.id),
            )
            .await?;
        match code(&reply) {
            RATE_LIMITED | QUEUE_FULL => Err(refusal(&reply)),
            _ => done(&reply),
        }
    }

    async fn count_start(&self, key: i64, rpm: u32) -> Result<(), Denial> {
        let k = self.keys(key);
        let reply = self
            .connections
            .invoke(
                "rate",
                self.scripts.rate.call().key(&k.rate).arg(rpm.max(1)),
            )
            .await?;
        match code(&reply) {
            RATE_LIMITED => Err(refusal(&reply)),
            _ => done(&reply),
        }
    }

    async fn wait_turn(
        &self,
        key: i64,
        limits: &KeyLimits,
        cost: &Cost,
        lease: &Lease,
    ) -> Result<Grant, Denial> {
        let watch = self.wakeups.watch(key);
        let mut seeds = 0;
        loop {
            // Registered before the check, so a wake-up during it is not lost.
            let notified = watch.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let month = Month::now();
            match self.try_turn(key, limits, cost, lease, month).await? {
                Turn::Started(grant) => return Ok(grant),
                Turn::Seed if seeds < MAX_SEEDS => {
                    seeds += 1;
                    self.seed(key, month).await?;
                    continue;
                }
                Turn::Seed => return Err(seed_failed()),
                Turn::Wait => {}
            }
            // A lost message or a lapsed lease elsewhere is noticed by the next poll,
            // which also keeps this waiter's queue place alive.
            let poll = self.options.poll_interval.min(self.options.queue_ttl / 4);
            let _ = tokio::time::timeout(poll, notified).await;
        }
    }

    async fn leave(&self, key: i64, lease: &Lease) -> Result<(), Denial> {
        let k = self.keys(key);
        let reply = self
            .connections
            .invoke(
                "leave",
                self.scripts
                    .leave
                    .call()
                    .key(&k.run)
                    .key(&k.grants)
                    .key(&k.queue)
                    .key(&k.qexp)
                    .arg(lease)
                    .arg(&self.channel)
                    .arg(&k.id),
            )
            .await?;
        done(&reply)
    }

    async fn finish(
        &self,
        key: i64,
        lease: &Lease,
        grant: &Grant,
        used_tokens: u64,
    ) -> Result<(), Denial> {
        self.release(key, lease, grant, used_tokens, None).await
    }

    async fn settle(
        &self,
        key: i64,
        lease: &Lease,
        grant: &Grant,
        row: &UsageRow,
    ) -> Result<(), Denial> {
        let used = row.prompt_tokens + row.completion_tokens;
        self.release(key, lease, grant, used, Some(row)).await
    }

    async fn renew(&self, key: i64, lease: &Lease) -> Result<(), Denial> {
        let k = self.keys(key);
        let reply = self
            .connections
            .invoke(
                "renew",
                self.scripts
                    .renew
                    .call()
                    .key(&k.run)
                    .key(&k.grants)
                    .key(&k.queue)
                    .key(&k.qexp)
                    .arg(lease)
                    .arg(self.ttl_ms())
                    .arg(&self.channel)
                    .arg(&k.id),
            )
            .await?;
        done(&reply)?;
        if value(&reply, 1) == 0 {
            tracing::debug!(key, lease, "renew: no live lease (finished or expired)");
        }
        Ok(())
    }

    async fn usage(&self, key: i64, month: Month) -> Result<Usage, Denial> {
        let k = self.keys(key);
        for _ in 0..=MAX_SEEDS {
            let reply = self
                .connections
                .invoke(
                    "usage",
                    self.scripts
                        .usage
                        .call()
                        .key(&k.run)
                        .key(&k.grants)
                        .key(&k.queue)
                        .key(&k.qexp)
                        .key(self.counter_key(key, month))
                        .arg(month.to_string())
                        .arg(&self.channel)
                        .arg(&k.id),
                )
                .await?;
            match code(&reply) {
                SEED => self.seed(key, month).await?,
                _ => {
                    done(&reply)?;
                    return Ok(Usage {
                        used: value(&reply, 1),
                        reserved: value(&reply, 2),
                    });
                }
            }
        }
        Err(seed_failed())
    }

    async fn occupancy(&self, key: i64) -> Result<(u32, u32), Denial> {
        let k = self.keys(key);
        let reply = self
            .connections
            .invoke(
                "occupancy",
                self.scripts
                    .occupancy
                    .call()
                    .key(&k.run)
                    .key(&k.grants)
                    .key(&k.queue)
                    .key(&k.qexp)
                    .arg(&self.channel)
                    .arg(&k.id),
            )
            .await?;
        done(&reply)?;
        let count = |i| u32::try_from(value(&reply, i)).unwrap_or(u32::MAX);
        Ok((count(1), count(2)))
    }

    async fn ping(&self) -> Result<(), Denial> {
        self.connections
            .call("ping", |mut c| async move {
                ::redis::cmd("PING").query_async::<()>(&mut c).await
            })
            .await
    }

    async fn exchange_service(
        &self,
        model: &str,
        mine: &[(i64, f64)],
    ) -> Result<Option<Vec<(i64, f64)>>, Denial> {
        let hash = format!("{}:service:{model}", self.prefix);
        let (totals,): (HashMap<i64, f64>,) = self
            .connections
            .call("service", |mut c| async move {
                let mut pipe = ::redis::pipe();
                for (key, amount) in mine {
                    pipe.cmd("HINCRBYFLOAT")
                        .arg(&hash)
                        .arg(key)
                        .arg(amount)
                        .ignore();
                }
                pipe.cmd("EXPIRE")
                    .arg(&hash)
                    .arg(SERVICE_TTL.as_secs())
                    .ignore();
                pipe.cmd("HGETALL").arg(&hash);
                pipe.query_async(&mut c).await
            })
            .await?;
        Ok(Some(totals.into_iter().collect()))
    }
}

/// How long a model's service totals outlive the last exchange: a fleet idle for
/// longer starts every key from nothing again.
const SERVICE_TTL: Duration = Duration::from_secs(3600);

/// The denial of a `RATE_LIMITED` or `QUEUE_FULL` reply.
fn refusal(reply: &[i64]) -> Denial {
    if code(reply) == RATE_LIMITED {
        Denial::RateLimited {
            retry_after: Duration::from_micros(value(reply, 1)),
        }
    } else {
        Denial::QueueFull {
            retry_after: QUEUE_FULL_RETRY_AFTER,
        }
    }
}

/// Checks a `DONE` reply.
fn done(reply: &[i64]) -> Result<(), Denial> {
    match code(reply) {
        DONE => Ok(()),
        other => Err(unexpected(other)),
    }
}

fn unexpected(code: i64) -> Denial {
    Denial::Unavailable(format!("redis: unexpected limiter reply {code}"))
}

fn code(reply: &[i64]) -> i64 {
    reply.first().copied().unwrap_or(-1)
}

/// Element `i` of a reply as a count (absent or negative: 0).
fn value(reply: &[i64], i: usize) -> u64 {
    reply.get(i).map_or(0, |&v| u64::try_from(v).unwrap_or(0))
}

/// A `RUNNING` or `BUDGET` reply of `start` (common.lua).
fn start_reply(reply: &[i64], limits: &KeyLimits, month: Month) -> Result<Grant, Denial> {
    match code(reply) {
        RUNNING => Ok(Grant {
            max_tokens: value(reply, 1),
            reserved: value(reply, 2),
            month,
        }),
        BUDGET => Err(Denial::BudgetExceeded {
            budget: limits.monthly_budget,
            used: value(reply, 1),
            reserved: value(reply, 2),
            needed: value(reply, 3),
            month,
        }),
        other => Err(unexpected(other)),
    }
}

fn seed_failed() -> Denial {
    Denial::Unavailable("redis: the used-tokens counter could not be seeded".to_owned())
}

/// `redis_url` names a node of a Redis Cluster (see [`RedisLimiter::refuse_cluster`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "redis_url names a node of a Redis Cluster, which fleetgate does not use: its journal and \
     wake-up channel are shared by all API keys, so they cannot live in one hash slot. Point \
     it at one primary (a replica beside it for failover); see \"Redis: failover and scale\" \
     in docs/operations.md"
)]
pub struct RedisClusterRefused;
