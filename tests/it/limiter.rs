//! The limiter, one suite for both backends.
//!
//! Each test is written once, as an async fn taking a [`Fixture`] (a way to make limiters
//! over one shared state, plus the fake usage ledger they seed from), and
//! [`limiter_tests!`] instantiates it for [`LocalLimiter`] and for [`RedisLimiter`]. The
//! Redis tests are ignored by default; run them with
//! `TEST_REDIS_URL=redis://127.0.0.1:6379 cargo test --test it limiter:: -- --include-ignored`.
//! Each uses its own key prefix and deletes its keys afterwards.
//!
//! Nothing here sleeps to synchronise: tests wait on the limiter's own futures, bounded by
//! timeouts, and look at `occupancy`.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use fleetgate::admission::local::LocalLimiter;
use fleetgate::admission::redis::{RedisLimiter, RedisLimiterOptions};
use fleetgate::admission::{
    Admitted, Cost, Denial, Grant, KeyLimits, Limiter, Month, Usage, UsageSource,
};
use fleetgate::config::LimitDefaults;
use fleetgate::store::LimitOverrides;
use futures_util::future::join_all;
use tokio::sync::mpsc;
use tokio::time::timeout;

use crate::common::redis_server::{RedisServer, free_port};

mod tls;

const REDIS_URL_VAR: &str = "TEST_REDIS_URL";

/// Upper bound for anything that should happen promptly.
const SOON: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------

/// The usage ledger: tokens per key and month, as the store would report them.
#[derive(Default)]
struct Ledger(Mutex<HashMap<(i64, Month), u64>>);

impl Ledger {
    fn set(&self, key: i64, month: Month, tokens: u64) {
        self.0.lock().unwrap().insert((key, month), tokens);
    }

    /// What the gateway writes before `finish`.
    fn record(&self, key: i64, month: Month, tokens: u64) {
        *self.0.lock().unwrap().entry((key, month)).or_default() += tokens;
    }
}

#[async_trait]
impl UsageSource for Ledger {
    async fn month_usage(&self, key: i64, month: Month) -> Result<u64, String> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .get(&(key, month))
            .copied()
            .unwrap_or(0))
    }
}

enum Backend {
    Local,
    Redis { url: String, prefix: String },
}

/// One test's limiter state. For Redis, every limiter it makes shares the same keys (as
/// replicas do), and the keys are deleted when it is dropped, also when the test fails.
struct Fixture {
    backend: Backend,
    ledger: Arc<Ledger>,
}

impl Fixture {
    fn local() -> Self {
        Self {
            backend: Backend::Local,
            ledger: Arc::default(),
        }
    }

    fn redis(test: &str) -> Self {
        let url = std::env::var(REDIS_URL_VAR).unwrap_or_else(|_| {
            panic!(
                "the Redis-backed limiter tests need a Redis server: set {REDIS_URL_VAR}, \
                 e.g. {REDIS_URL_VAR}=redis://127.0.0.1:6379"
            )
        });
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let prefix = format!("fleetgate-test:{test}:{}:{nanos}", std::process::id());
        Self {
            backend: Backend::Redis { url, prefix },
            ledger: Arc::default(),
        }
    }

    /// A fresh limiter on this fixture's state (for Redis, one more replica).
    fn limiter(&self) -> Arc<dyn Limiter> {
        match &self.backend {
            Backend::Local => Arc::new(LocalLimiter::new(self.ledger.clone())),
            Backend::Redis { .. } => Arc::new(self.redis_limiter(RedisLimiterOptions::default())),
        }
    }

    fn redis_limiter(&self, options: RedisLimiterOptions) -> RedisLimiter {
        let Backend::Redis { url, prefix } = &self.backend else {
            panic!("a Redis-only test given another backend");
        };
        RedisLimiter::connect_with(url, prefix, self.ledger.clone(), options).unwrap()
    }

    /// A plain connection to the fixture's Redis, for looking behind the limiter.
    fn redis_connection(&self) -> Option<redis::Connection> {
        match &self.backend {
            Backend::Local => None,
            Backend::Redis { url, .. } => Some(
                redis::Client::open(url.as_str())
                    .unwrap()
                    .get_connection()
                    .unwrap(),
            ),
        }
    }

    fn redis_keys(&self, connection: &mut redis::Connection) -> Vec<String> {
        let Backend::Redis { prefix, .. } = &self.backend else {
            return Vec::new();
        };
        redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query(connection)
            .unwrap()
    }

    /// The one Redis key of this test whose name ends with `suffix` (`":run"`, ...).
    fn redis_key(&self, connection: &mut redis::Connection, suffix: &str) -> String {
        self.redis_keys(connection)
            .into_iter()
            .find(|k| k.ends_with(suffix))
            .unwrap()
    }

    /// With Redis: every key the limiter left behind expires by itself.
    fn assert_all_keys_expire(&self) {
        let Some(mut connection) = self.redis_connection() else {
            return;
        };
        let keys = self.redis_keys(&mut connection);
        assert!(!keys.is_empty());
        for key in keys {
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut connection).unwrap();
            assert!(ttl > 0, "{key} has no expiry (PTTL {ttl})");
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let Some(mut connection) = self.redis_connection() else {
            return;
        };
        let keys = self.redis_keys(&mut connection);
        if !keys.is_empty() {
            let _: Result<i64, _> = redis::cmd("DEL").arg(keys).query(&mut connection);
        }
    }
}

fn default_limits() -> KeyLimits {
    KeyLimits::resolve(&LimitDefaults::default(), &LimitOverrides::default())
}

fn limits(
    monthly_budget: u64,
    requests_per_minute: u32,
    max_concurrent: u32,
    max_queued: u32,
) -> KeyLimits {
    KeyLimits {
        monthly_budget,
        requests_per_minute,
        max_concurrent,
        max_queued,
        share: 1,
    }
}

fn cost(prompt_tokens: u64, fan_out: u64, max_tokens: u64) -> Cost {
    Cost {
        prompt_tokens,
        fan_out,
        max_tokens,
    }
}

#[track_caller]
fn running(admitted: Result<Admitted, Denial>) -> Grant {
    match admitted {
        Ok(Admitted::Running(grant)) => grant,
        other => panic!("expected a running slot, got {other:?}"),
    }
}

#[track_caller]
fn queued(admitted: Result<Admitted, Denial>) {
    assert_eq!(admitted, Ok(Admitted::Queued));
}

/// Waits for `f`, at most [`SOON`].
async fn soon<T>(what: &str, f: impl Future<Output = T>) -> T {
    timeout(SOON, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not done within {SOON:?}"))
}

// ---------------------------------------------------------------------------------------
// Budget
// ---------------------------------------------------------------------------------------

/// 64 concurrent admissions against a budget of 1000 with a worst case of 60 each: exactly
/// 16 full grants and one clamped to the 40 tokens left; the rest refused.
async fn budget_is_never_exceeded_under_concurrency(fx: Fixture) {
    let limiter = fx.limiter();
    let limits = limits(1000, 10_000, 64, 64);
    let each = cost(10, 1, 50);
    let attempts = (0..64).map(|i| {
        let limiter = limiter.clone();
        tokio::spawn(async move {
            let lease = format!("r{i}");
            let admitted = limiter.admit(7, &limits, &each, &lease).await;
            (lease, admitted)
        })
    });
    let mut grants = Vec::new();
    let mut refused = 0;
    for outcome in join_all(attempts).await {
        match outcome.unwrap() {
            (lease, Ok(Admitted::Running(grant))) => grants.push((lease, grant)),
            (_, Err(Denial::BudgetExceeded { budget, needed, .. })) => {
                assert_eq!((budget, needed), (1000, 11));
                refused += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let mut max_tokens: Vec<u64> = grants.iter().map(|(_, g)| g.max_tokens).collect();
    max_tokens.sort_unstable();
    let mut expected = vec![30];
    expected.extend([50; 16]);
    assert_eq!(max_tokens, expected);
    assert_eq!(refused, 64 - 17);
    for (_, grant) in &grants {
        assert_eq!(grant.reserved, 10 + grant.max_tokens);
    }
    let reserved: u64 = grants.iter().map(|(_, g)| g.reserved).sum();
    assert_eq!(reserved, 1000);
    let month = grants[0].1.month;
    assert_eq!(
        limiter.usage(7, month).await.unwrap(),
        Usage {
            used: 0,
            reserved: 1000
        }
    );

    // Settle each with its real usage: the counters add up.
    let mut total = 0;
    for (i, (lease, grant)) in grants.iter().enumerate() {
        let used = 5 + i as u64;
        total += used;
        fx.ledger.record(7, grant.month, used);
        limiter.finish(7, lease, grant, used).await.unwrap();
    }
    assert_eq!(
        limiter.usage(7, month).await.unwrap(),
        Usage {
            used: total,
            reserved: 0
        }
    );
    assert_eq!(limiter.occupancy(7).await.unwrap(), (0, 0));
    // Exactly the rest of the budget is available again.
    let rest = running(limiter.admit(7, &limits, &cost(0, 1, 10_000), "rest").await);
    assert_eq!(rest.max_tokens, 1000 - total);
    fx.assert_all_keys_expire();
}

/// The clamp gives the largest `max_tokens` whose worst case fits; nothing fitting refuses.
async fn clamp_fits_the_remaining_budget(fx: Fixture) {
    let limiter = fx.limiter();
    let limits = limits(1000, 600, 16, 64);
    // Worst case 100 + 4 × 500 = 2100: clamped to (1000 − 100) / 4 = 225.
    let a = running(limiter.admit(1, &limits, &cost(100, 4, 500), "a").await);
    assert_eq!((a.max_tokens, a.reserved), (225, 1000));
    let month = a.month;
    match limiter.admit(1, &limits, &cost(0, 1, 1), "b").await {
        Err(Denial::BudgetExceeded {
            budget,
            used,
            reserved,
            needed,
            month: m,
        }) => assert_eq!(
            (budget, used, reserved, needed, m),
            (1000, 0, 1000, 1, month)
        ),
        other => panic!("expected budget_exceeded, got {other:?}"),
    }
    limiter.finish(1, "a", &a, 396).await.unwrap();

    // 604 left: 600 + 2 × 2 fits, not 600 + 2 × 10.
    let b = running(limiter.admit(1, &limits, &cost(600, 2, 10), "b").await);
    assert_eq!((b.max_tokens, b.reserved), (2, 604));
    limiter.finish(1, "b", &b, 0).await.unwrap();
    // A request that fits whole is not clamped.
    let c = running(limiter.admit(1, &limits, &cost(4, 3, 200), "c").await);
    assert_eq!((c.max_tokens, c.reserved), (200, 604));
    limiter.finish(1, "c", &c, 0).await.unwrap();

    // 603 + 2 × 1 = 605 > 604: not one token per completion fits.
    match limiter.admit(1, &limits, &cost(603, 2, 10), "d").await {
        Err(Denial::BudgetExceeded {
            budget,
            used,
            reserved,
            needed,
            ..
        }) => assert_eq!((budget, used, reserved, needed), (1000, 396, 0, 605)),
        other => panic!("expected budget_exceeded, got {other:?}"),
    }
    // A prompt alone larger than the rest refuses too.
    assert!(matches!(
        limiter.admit(1, &limits, &cost(700, 1, 10), "e").await,
        Err(Denial::BudgetExceeded { .. })
    ));
    assert_eq!(
        limiter.usage(1, month).await.unwrap(),
        Usage {
            used: 396,
            reserved: 0
        }
    );
    assert_eq!(limiter.occupancy(1).await.unwrap(), (0, 0));
}

/// A fresh limiter seeds its counter from the ledger; with Redis, a lost counter is
/// rebuilt from it.
async fn counters_are_seeded_from_the_ledger(fx: Fixture) {
    let month = Month::now();
    fx.ledger.set(3, month, 900);
    let limiter = fx.limiter();
    let limits = limits(1000, 600, 16, 64);
    let a = running(limiter.admit(3, &limits, &cost(50, 1, 100), "a").await);
    assert_eq!((a.max_tokens, a.reserved, a.month), (50, 100, month));
    assert_eq!(
        limiter.usage(3, month).await.unwrap(),
        Usage {
            used: 900,
            reserved: 100
        }
    );
    fx.ledger.record(3, month, 30);
    limiter.finish(3, "a", &a, 30).await.unwrap();
    assert_eq!(
        limiter.usage(3, month).await.unwrap(),
        Usage {
            used: 930,
            reserved: 0
        }
    );

    if let Some(mut connection) = fx.redis_connection() {
        // Redis loses the counter; meanwhile the ledger also got another replica's usage.
        fx.ledger.set(3, month, 960);
        let counter = format!("{}:{{3}}:used:{month}", redis_prefix(&fx));
        let deleted: i64 = redis::cmd("DEL")
            .arg(&counter)
            .query(&mut connection)
            .unwrap();
        assert_eq!(deleted, 1);
        match limiter.admit(3, &limits, &cost(50, 1, 100), "b").await {
            Err(Denial::BudgetExceeded {
                used,
                reserved,
                needed,
                ..
            }) => assert_eq!((used, reserved, needed), (960, 0, 51)),
            other => panic!("expected budget_exceeded, got {other:?}"),
        }
        let rebuilt: u64 = redis::cmd("GET")
            .arg(&counter)
            .query(&mut connection)
            .unwrap();
        assert_eq!(rebuilt, 960);
        let ttl: i64 = redis::cmd("TTL")
            .arg(&counter)
            .query(&mut connection)
            .unwrap();
        assert!(
            ttl > 40 * 24 * 3600 - 60,
            "the counter outlives its month: TTL {ttl}"
        );

        // The same through `usage`, and after a `finish` that found no counter (the
        // ledger already has its tokens).
        let c = running(limiter.admit(3, &limits, &cost(10, 1, 10), "c").await);
        redis::cmd("DEL")
            .arg(&counter)
            .exec(&mut connection)
            .unwrap();
        fx.ledger.record(3, month, 15);
        limiter.finish(3, "c", &c, 15).await.unwrap();
        assert_eq!(
            limiter.usage(3, month).await.unwrap(),
            Usage {
                used: 975,
                reserved: 0
            }
        );
    }
}

fn redis_prefix(fx: &Fixture) -> &str {
    match &fx.backend {
        Backend::Redis { prefix, .. } => prefix,
        Backend::Local => unreachable!(),
    }
}

// ---------------------------------------------------------------------------------------
// Concurrency and the queue
// ---------------------------------------------------------------------------------------

/// With the default limits: 16 run, 64 wait, the 81st is refused; waiters start in
/// arrival order as slots free; one that leaves lets the next move up.
async fn queue_is_fifo_and_bounded(fx: Fixture) {
    let limiter = fx.limiter();
    let limits = default_limits();
    assert_eq!((limits.max_concurrent, limits.max_queued), (16, 64));
    let each = cost(1, 1, 1);
    let mut running_leases = std::collections::VecDeque::new();
    for i in 0..16 {
        let lease = format!("r{i}");
        let grant = running(limiter.admit(1, &limits, &each, &lease).await);
        running_leases.push_back((lease, grant));
    }
    for i in 0..64 {
        queued(limiter.admit(1, &limits, &each, &format!("w{i}")).await);
    }
    assert!(matches!(
        limiter.admit(1, &limits, &each, "w64").await,
        Err(Denial::QueueFull { .. })
    ));
    assert_eq!(limiter.occupancy(1).await.unwrap(), (16, 64));

    let (started, mut starts) = mpsc::unbounded_channel();
    let mut waiters = HashMap::new();
    for i in 0..64 {
        let limiter = limiter.clone();
        let started = started.clone();
        let task = tokio::spawn(async move {
            let lease = format!("w{i}");
            let grant = limiter.wait_turn(1, &limits, &each, &lease).await;
            started.send((i, lease, grant)).unwrap();
        });
        waiters.insert(i, task);
    }

    // Frees one slot and returns who took it.
    async fn free_one(
        limiter: &Arc<dyn Limiter>,
        running_leases: &mut std::collections::VecDeque<(String, Grant)>,
        starts: &mut mpsc::UnboundedReceiver<(usize, String, Result<Grant, Denial>)>,
    ) -> usize {
        let (lease, grant) = running_leases.pop_front().unwrap();
        limiter.finish(1, &lease, &grant, 1).await.unwrap();
        let (i, lease, grant) = soon("a waiter starts", starts.recv()).await.unwrap();
        running_leases.push_back((lease, grant.unwrap()));
        i
    }

    for expected in 0..8 {
        assert_eq!(
            free_one(&limiter, &mut running_leases, &mut starts).await,
            expected
        );
    }
    assert_eq!(limiter.occupancy(1).await.unwrap(), (16, 56));

    // The first in line goes away: the next one moves up.
    let gone = waiters.remove(&8).unwrap();
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    limiter.leave(1, "w8").await.unwrap();
    assert_eq!(limiter.occupancy(1).await.unwrap(), (16, 55));
    assert_eq!(
        free_one(&limiter, &mut running_leases, &mut starts).await,
        9
    );

    // One in the middle goes away: it is skipped.
    let gone = waiters.remove(&20).unwrap();
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    limiter.leave(1, "w20").await.unwrap();
    assert_eq!(limiter.occupancy(1).await.unwrap(), (16, 53));
    for expected in (10..64).filter(|&i| i != 20) {
        assert_eq!(
            free_one(&limiter, &mut running_leases, &mut starts).await,
            expected
        );
    }
    assert_eq!(limiter.occupancy(1).await.unwrap(), (16, 0));
    while let Some((lease, grant)) = running_leases.pop_front() {
        limiter.finish(1, &lease, &grant, 1).await.unwrap();
    }
    assert_eq!(limiter.occupancy(1).await.unwrap(), (0, 0));
    fx.assert_all_keys_expire();
}

/// `admit` takes a free slot directly only when nobody waits.
async fn admit_does_not_overtake_the_queue(fx: Fixture) {
    let limiter = fx.limiter();
    let limits = limits(1000, 600, 1, 4);
    let each = cost(1, 1, 1);
    let a = running(limiter.admit(2, &limits, &each, "a").await);
    queued(limiter.admit(2, &limits, &each, "b").await);
    limiter.finish(2, "a", &a, 1).await.unwrap();
    // A slot is free, but b is waiting for it.
    assert_eq!(limiter.occupancy(2).await.unwrap(), (0, 1));
    queued(limiter.admit(2, &limits, &each, "c").await);
    assert_eq!(limiter.occupancy(2).await.unwrap(), (0, 2));

    let c_waits = {
        let limiter = limiter.clone();
        tokio::spawn(async move { limiter.wait_turn(2, &limits, &each, "c").await })
    };
    let b = soon("b starts", limiter.wait_turn(2, &limits, &each, "b"))
        .await
        .unwrap();
    assert_eq!(limiter.occupancy(2).await.unwrap(), (1, 1));
    assert!(!c_waits.is_finished());
    limiter.finish(2, "b", &b, 1).await.unwrap();
    let c = soon("c starts", c_waits).await.unwrap().unwrap();
    assert_eq!(limiter.occupancy(2).await.unwrap(), (1, 0));
    limiter.finish(2, "c", &c, 1).await.unwrap();
}

/// When the budget refuses a waiter at its turn, it leaves the queue and the next one
/// moves up.
async fn budget_refusal_at_the_turn_leaves_the_queue(fx: Fixture) {
    let limiter = fx.limiter();
    let limits = limits(100, 600, 1, 4);
    let a = running(limiter.admit(4, &limits, &cost(10, 1, 10), "a").await);
    queued(limiter.admit(4, &limits, &cost(95, 1, 10), "big").await);
    queued(limiter.admit(4, &limits, &cost(10, 1, 10), "small").await);
    let big = {
        let limiter = limiter.clone();
        tokio::spawn(async move { limiter.wait_turn(4, &limits, &cost(95, 1, 10), "big").await })
    };
    let small = {
        let limiter = limiter.clone();
        tokio::spawn(async move {
            limiter
                .wait_turn(4, &limits, &cost(10, 1, 10), "small")
                .await
        })
    };
    limiter.finish(4, "a", &a, 10).await.unwrap();
    // 90 left: the big one (95 + 1) does not fit.
    match soon("big's turn", big).await.unwrap() {
        Err(Denial::BudgetExceeded {
            used,
            reserved,
            needed,
            ..
        }) => assert_eq!((used, reserved, needed), (10, 0, 96)),
        other => panic!("expected budget_exceeded, got {other:?}"),
    }
    let small = soon("small's turn", small).await.unwrap().unwrap();
    assert_eq!((small.max_tokens, small.reserved), (10, 20));
    assert_eq!(limiter.occupancy(4).await.unwrap(), (1, 0));
    limiter.finish(4, "small", &small, 5).await.unwrap();
}

/// Finishing twice, or a lease never admitted, changes nothing; leaving likewise; a
/// waiter that left gets an error from `wait_turn` rather than waiting forever.
async fn finish_and_leave_are_idempotent(fx: Fixture) {
    let limiter = fx.limiter();
    let limits = limits(1000, 600, 1, 4);
    let each = cost(10, 1, 90);
    let a = running(limiter.admit(5, &limits, &each, "a").await);
    queued(limiter.admit(5, &limits, &each, "b").await);
    limiter.finish(5, "a", &a, 100).await.unwrap();
    limiter.finish(5, "a", &a, 100).await.unwrap();
    limiter.finish(5, "never", &a, 100).await.unwrap();
    assert_eq!(
        limiter.usage(5, a.month).await.unwrap(),
        Usage {
            used: 100,
            reserved: 0
        }
    );
    assert_eq!(limiter.occupancy(5).await.unwrap(), (0, 1));

    // b takes the one slot; finishing a twice did not free a second.
    let b = soon("b starts", limiter.wait_turn(5, &limits, &each, "b"))
        .await
        .unwrap();
    queued(limiter.admit(5, &limits, &each, "c").await);
    assert_eq!(limiter.occupancy(5).await.unwrap(), (1, 1));
    limiter.leave(5, "c").await.unwrap();
    limiter.leave(5, "c").await.unwrap();
    limiter.leave(5, "never").await.unwrap();
    assert_eq!(limiter.occupancy(5).await.unwrap(), (1, 0));
    assert!(matches!(
        soon(
            "wait_turn after leave",
            limiter.wait_turn(5, &limits, &each, "c")
        )
        .await,
        Err(Denial::Unavailable(_))
    ));

    limiter.finish(5, "b", &b, 50).await.unwrap();
    limiter.finish(5, "b", &b, 50).await.unwrap();
    assert_eq!(
        limiter.usage(5, a.month).await.unwrap(),
        Usage {
            used: 150,
            reserved: 0
        }
    );
    assert_eq!(limiter.occupancy(5).await.unwrap(), (0, 0));
    // `renew` of a finished lease is harmless.
    limiter.renew(5, "b").await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Rate
// ---------------------------------------------------------------------------------------

/// rpm = 60: a burst of 60, then refused with a retry_after of at most a second.
async fn rate_allows_a_burst_then_limits(fx: Fixture) {
    let limiter = fx.limiter();
    let limits = limits(10_000_000, 60, 1000, 1000);
    let started = Instant::now();
    let mut allowed = 0u32;
    let retry_after = loop {
        match limiter
            .admit(6, &limits, &cost(1, 1, 1), &format!("r{allowed}"))
            .await
        {
            Ok(Admitted::Running(_)) => allowed += 1,
            Err(Denial::RateLimited { retry_after }) => break retry_after,
            other => panic!("unexpected {other:?}"),
        }
        assert!(allowed <= 200, "never rate limited");
    };
    let elapsed = started.elapsed().as_secs_f64();
    assert!(allowed >= 60, "only {allowed} allowed");
    assert!(
        f64::from(allowed) <= 60.0 + elapsed + 1.0,
        "{allowed} allowed in {elapsed:.1} s"
    );
    assert!(
        retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1),
        "retry_after {retry_after:?}"
    );
    assert_eq!(limiter.occupancy(6).await.unwrap(), (allowed, 0));
}

/// A queue_full or budget refusal counts as a start against the rate.
async fn refusals_count_against_the_rate(fx: Fixture) {
    let limiter = fx.limiter();
    // rpm 3: one start every 20 s after the burst.
    let full = limits(1000, 3, 1, 0);
    running(limiter.admit(1, &full, &cost(1, 1, 1), "a").await);
    for lease in ["b", "c"] {
        assert!(matches!(
            limiter.admit(1, &full, &cost(1, 1, 1), lease).await,
            Err(Denial::QueueFull { .. })
        ));
    }
    match limiter.admit(1, &full, &cost(1, 1, 1), "d").await {
        Err(Denial::RateLimited { retry_after }) => assert!(
            retry_after > Duration::from_secs(15) && retry_after <= Duration::from_secs(20),
            "retry_after {retry_after:?}"
        ),
        other => panic!("expected rate_limited, got {other:?}"),
    }
    assert_eq!(limiter.occupancy(1).await.unwrap(), (1, 0));

    let broke = limits(0, 2, 16, 64);
    for lease in ["e", "f"] {
        assert!(matches!(
            limiter.admit(2, &broke, &cost(1, 1, 1), lease).await,
            Err(Denial::BudgetExceeded { .. })
        ));
    }
    assert!(matches!(
        limiter.admit(2, &broke, &cost(1, 1, 1), "g").await,
        Err(Denial::RateLimited { .. })
    ));
}

/// A peek refuses what admit would refuse on the rate or the full queue, and takes
/// nothing: after any number of peeks, admit decides as if none had been made.
async fn a_peek_refuses_as_admit_would_and_takes_nothing(fx: Fixture) {
    let limiter = fx.limiter();
    // rpm 2, one slot, one queue place.
    let rated = limits(1000, 2, 1, 1);
    for _ in 0..5 {
        limiter.peek(3, &rated).await.unwrap();
    }
    running(limiter.admit(3, &rated, &cost(1, 1, 1), "a").await);
    limiter.peek(3, &rated).await.unwrap();
    queued(limiter.admit(3, &rated, &cost(1, 1, 1), "b").await);
    assert!(matches!(
        limiter.peek(3, &rated).await,
        Err(Denial::RateLimited { .. })
    ));
    assert_eq!(limiter.occupancy(3).await.unwrap(), (1, 1));

    // No rate: the full queue refuses.
    let unrated = limits(1000, 0, 1, 1);
    assert!(matches!(
        limiter.peek(3, &unrated).await,
        Err(Denial::QueueFull { .. })
    ));
    limiter.leave(3, "b").await.unwrap();
    limiter.peek(3, &unrated).await.unwrap();
    assert_eq!(limiter.occupancy(3).await.unwrap(), (1, 0));
}

/// `count_start` (the Workbench's routes) draws on the same rate as admissions and
/// takes nothing else: no slot, no queue place, no budget.
async fn a_counted_start_shares_the_rate_and_takes_nothing_else(fx: Fixture) {
    let limiter = fx.limiter();
    // rpm 3, one slot, no queue, a budget of nothing.
    let limits = limits(0, 3, 1, 0);
    for _ in 0..2 {
        limiter
            .count_start(7, limits.requests_per_minute)
            .await
            .unwrap();
    }
    assert_eq!(limiter.occupancy(7).await.unwrap(), (0, 0));
    assert!(matches!(
        limiter.admit(7, &limits, &cost(1, 1, 1), "a").await,
        Err(Denial::BudgetExceeded { .. })
    ));
    match limiter.count_start(7, limits.requests_per_minute).await {
        Err(Denial::RateLimited { retry_after }) => assert!(
            retry_after > Duration::from_secs(15) && retry_after <= Duration::from_secs(20),
            "retry_after {retry_after:?}"
        ),
        other => panic!("expected rate_limited, got {other:?}"),
    }
    assert!(matches!(
        limiter.admit(7, &limits, &cost(1, 1, 1), "b").await,
        Err(Denial::RateLimited { .. })
    ));
}

// ---------------------------------------------------------------------------------------
// Redis only: replicas, leases, outages
// ---------------------------------------------------------------------------------------

/// A waiter on one replica starts when a slot frees on another, woken by the pub/sub
/// message (its own polling is set to a minute, so nothing else could wake it in time).
async fn waiters_wake_across_replicas(fx: Fixture) {
    let a = fx.limiter();
    let b = Arc::new(fx.redis_limiter(RedisLimiterOptions {
        poll_interval: Duration::from_secs(60),
        ..RedisLimiterOptions::default()
    }));
    let limits = limits(1000, 600, 1, 4);
    let each = cost(1, 1, 1);
    let first = running(a.admit(1, &limits, &each, "first").await);
    queued(b.admit(1, &limits, &each, "second").await);
    let second = {
        let b = b.clone();
        tokio::spawn(async move { b.wait_turn(1, &limits, &each, "second").await })
    };
    assert_eq!(a.occupancy(1).await.unwrap(), (1, 1));
    a.finish(1, "first", &first, 1).await.unwrap();
    let second = soon("the waiter on the other replica starts", second)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.occupancy(1).await.unwrap(), (1, 0));
    b.finish(1, "second", &second, 1).await.unwrap();
}

/// A replica that crashes leaves a running slot, its reservation and a queue place; the
/// slot and the place lapse after their TTLs and the next waiter starts, while the
/// reservation still counts until a late settlement. Renewed leases do not lapse.
async fn leases_of_a_crashed_replica_expire(fx: Fixture) {
    let ttl = Duration::from_millis(1000);
    let short = RedisLimiterOptions {
        lease_ttl: ttl,
        ..RedisLimiterOptions::default()
    };
    let limits = limits(1000, 600, 1, 4);
    let each = cost(10, 1, 90);

    let t0 = Instant::now();
    let crashed = fx.redis_limiter(short);
    let lost = running(crashed.admit(1, &limits, &each, "lost").await);
    queued(crashed.admit(1, &limits, &each, "abandoned").await);
    drop(crashed); // never finishes, renews, polls or leaves

    let healthy = fx.limiter();
    queued(healthy.admit(1, &limits, &each, "next").await);
    let next = soon(
        "the slot comes back",
        healthy.wait_turn(1, &limits, &each, "next"),
    )
    .await
    .unwrap();
    assert!(t0.elapsed() >= ttl, "started before the leases lapsed");
    assert_eq!(healthy.occupancy(1).await.unwrap(), (1, 0));
    // The lapsed slot's reservation still counts (for two minutes), beside next's…
    assert_eq!(
        healthy.usage(1, lost.month).await.unwrap(),
        Usage {
            used: 0,
            reserved: lost.reserved + next.reserved
        }
    );
    // …so a late settlement (the replica was only frozen) is counted, exactly once.
    healthy.finish(1, "lost", &lost, 100).await.unwrap();
    healthy.finish(1, "lost", &lost, 100).await.unwrap();
    assert_eq!(
        healthy.usage(1, lost.month).await.unwrap(),
        Usage {
            used: 100,
            reserved: next.reserved
        }
    );
    assert_eq!(healthy.occupancy(1).await.unwrap(), (1, 0));
    healthy.finish(1, "next", &next, 20).await.unwrap();

    // A renewed lease holds its slot past the TTL, and frees it once renewals stop.
    let renewing = Arc::new(fx.redis_limiter(short));
    let kept = running(renewing.admit(1, &limits, &each, "kept").await);
    queued(healthy.admit(1, &limits, &each, "behind").await);
    let behind = {
        let healthy = healthy.clone();
        tokio::spawn(async move { healthy.wait_turn(1, &limits, &each, "behind").await })
    };
    let mut renewals = tokio::time::interval(ttl / 10);
    let renewed_until = Instant::now() + ttl * 3;
    while Instant::now() < renewed_until {
        renewals.tick().await;
        renewing.renew(1, "kept").await.unwrap();
    }
    assert!(!behind.is_finished(), "the renewed slot was lost");
    assert_eq!(healthy.occupancy(1).await.unwrap(), (1, 1));
    let behind = soon("the slot comes back", behind).await.unwrap().unwrap();
    assert_eq!(
        healthy.usage(1, kept.month).await.unwrap(),
        Usage {
            used: 120,
            // kept's slot lapsed when its renewals stopped; its reservation still counts.
            reserved: kept.reserved + behind.reserved
        }
    );
    healthy.finish(1, "behind", &behind, 1).await.unwrap();
}

/// A crashed replica's slot set can expire whole (seconds after its last lease) before
/// any script purges it, leaving the reservation without its slot. The next look at the
/// key sets it aside as lapsed — still counted, and dropped after the lapse window —
/// rather than counting it for as long as the key stays busy.
async fn a_reservation_left_without_its_slot_set_is_set_aside(fx: Fixture) {
    let short = RedisLimiterOptions {
        lease_ttl: Duration::from_millis(100),
        ..RedisLimiterOptions::default()
    };
    let limits = limits(1000, 600, 1, 4);
    let each = cost(10, 1, 90);
    let crashed = fx.redis_limiter(short);
    let lost = running(crashed.admit(1, &limits, &each, "lost").await);
    drop(crashed);
    let mut redis = fx.redis_connection().unwrap();
    let run = fx.redis_key(&mut redis, ":run");
    // Nothing touches the key until its slot set has expired: the fault simulated, with
    // the expiry brought forward to now (it lets the set outlive its last lease).
    let ttl: i64 = redis::cmd("PTTL").arg(&run).query(&mut redis).unwrap();
    assert!(ttl > 100, "the slot set outlives its lease: PTTL {ttl}");
    let expired: i64 = redis::cmd("PEXPIRE")
        .arg(&run)
        .arg(1)
        .query(&mut redis)
        .unwrap();
    assert_eq!(expired, 1);
    let gone = timeout(Duration::from_secs(5), async {
        while redis::cmd("EXISTS")
            .arg(&run)
            .query::<i64>(&mut redis)
            .unwrap()
            == 1
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    gone.await.expect("the slot set expires");

    let healthy = fx.limiter();
    assert_eq!(
        healthy.usage(1, lost.month).await.unwrap(),
        Usage {
            used: 0,
            reserved: lost.reserved
        }
    );
    let grants: std::collections::BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(run.replace(":run", ":grants"))
        .query(&mut redis)
        .unwrap();
    let reservations: Vec<&String> = grants.keys().filter(|f| !f.starts_with('#')).collect();
    assert_eq!(
        reservations,
        ["~lost"],
        "set aside as lapsed, to be dropped in time"
    );
    // The bookkeeping beside it (which spares a busy key's admissions a read of every
    // reservation) was written anew by that look.
    assert_eq!(grants["#running"], "0");
    assert_eq!(grants["#lapsed"], "1");
    assert_eq!(
        grants[&format!("#sum:{}", lost.month)],
        lost.reserved.to_string()
    );
    // And a late finish still settles it, once.
    healthy.finish(1, "lost", &lost, 30).await.unwrap();
    assert_eq!(
        healthy.usage(1, lost.month).await.unwrap(),
        Usage {
            used: 30,
            reserved: 0
        }
    );
}

/// Reservations whose bookkeeping is missing or wrong (made by a version that kept
/// none, or damaged) are still all counted: the next look counts them anew, and the
/// budget holds from there on.
async fn reservations_without_their_bookkeeping_are_counted(fx: Fixture) {
    let limits = limits(1000, 600, 4, 4);
    let each = cost(10, 1, 90);
    let limiter = fx.limiter();
    let a = running(limiter.admit(1, &limits, &each, "a").await);
    let b = running(limiter.admit(1, &limits, &each, "b").await);
    let c = running(limiter.admit(1, &limits, &each, "c").await);
    let mut redis = fx.redis_connection().unwrap();
    let grants = fx.redis_key(&mut redis, ":grants");
    let bookkeeping = |redis: &mut redis::Connection| -> Vec<String> {
        redis::cmd("HKEYS")
            .arg(&grants)
            .query::<Vec<String>>(redis)
            .unwrap()
            .into_iter()
            .filter(|f| f.starts_with('#'))
            .collect()
    };
    let kept = bookkeeping(&mut redis);
    assert!(
        !kept.is_empty(),
        "bookkeeping is kept beside the reservations"
    );
    redis::cmd("HDEL")
        .arg(&grants)
        .arg(&kept)
        .query::<i64>(&mut redis)
        .unwrap();
    // A finish where it is missing leaves it missing (counting from 0 beside
    // reservations it never saw would make a wrong sum look kept)...
    limiter.finish(1, "a", &a, 50).await.unwrap();
    assert_eq!(bookkeeping(&mut redis), Vec::<String>::new());
    // ... and the next look counts every reservation anew.
    let both = Usage {
        used: 50,
        reserved: b.reserved + c.reserved,
    };
    assert_eq!(limiter.usage(1, a.month).await.unwrap(), both);
    assert!(!bookkeeping(&mut redis).is_empty(), "written anew");
    // Wrong rather than missing: a sum of 0 beside a count that does not match the slots.
    redis::cmd("HSET")
        .arg(&grants)
        .arg("#running")
        .arg(7)
        .arg(format!("#sum:{}", a.month))
        .arg(0)
        .query::<i64>(&mut redis)
        .unwrap();
    assert_eq!(limiter.usage(1, a.month).await.unwrap(), both);
    // From there on it is kept: a fourth start fits what is left, a finish settles once.
    let d = running(limiter.admit(1, &limits, &each, "d").await);
    limiter.finish(1, "b", &b, 20).await.unwrap();
    assert_eq!(
        limiter.usage(1, a.month).await.unwrap(),
        Usage {
            used: 70,
            reserved: c.reserved + d.reserved
        }
    );
}

async fn expect_unavailable<T: Debug>(what: &str, call: impl Future<Output = Result<T, Denial>>) {
    let started = Instant::now();
    let outcome = timeout(Duration::from_secs(3), call)
        .await
        .unwrap_or_else(|_| panic!("{what} hung while Redis is down"));
    eprintln!("{what}: {outcome:?} after {:?}", started.elapsed());
    assert!(
        matches!(outcome, Err(Denial::Unavailable(_))),
        "{what}: {outcome:?}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{what} took {:?}",
        started.elapsed()
    );
}

/// Redis down (nothing listens on the port, or nothing answers): the limiter constructs,
/// and every call refuses promptly.
#[tokio::test]
async fn redis_down_refuses_promptly() {
    let port = free_port();
    let limiter = RedisLimiter::connect(
        &format!("redis://127.0.0.1:{port}"),
        "fleetgate-test:down",
        Arc::new(Ledger::default()),
    )
    .expect("constructs while Redis is down");
    every_call_is_unavailable(&limiter, 2).await;

    // A server that accepts connections but never answers (the kernel completes the
    // handshakes of a listener that accepts nothing).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let limiter = RedisLimiter::connect(
        &format!("redis://{}", silent.local_addr().unwrap()),
        "fleetgate-test:silent",
        Arc::new(Ledger::default()),
    )
    .unwrap();
    every_call_is_unavailable(&limiter, 1).await;

    assert!(
        RedisLimiter::connect("not a url", "p", Arc::new(Ledger::default())).is_err(),
        "a malformed URL is refused"
    );
}

async fn every_call_is_unavailable(limiter: &RedisLimiter, rounds: usize) {
    let limits = default_limits();
    let each = cost(1, 1, 1);
    let grant = Grant {
        max_tokens: 1,
        reserved: 2,
        month: Month::now(),
    };
    for _ in 0..rounds {
        expect_unavailable("admit", limiter.admit(1, &limits, &each, "a")).await;
        expect_unavailable("wait_turn", limiter.wait_turn(1, &limits, &each, "a")).await;
        expect_unavailable("leave", limiter.leave(1, "a")).await;
        expect_unavailable("finish", limiter.finish(1, "a", &grant, 1)).await;
        expect_unavailable("renew", limiter.renew(1, "a")).await;
        expect_unavailable("usage", limiter.usage(1, Month::now())).await;
        expect_unavailable("occupancy", limiter.occupancy(1)).await;
    }
}

/// Redis goes away and comes back (empty, as after a restart without persistence): calls
/// refuse meanwhile, then work again by themselves; the counter is rebuilt from the
/// ledger and the wake-up subscription is restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH"]
async fn recovers_when_redis_returns() {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let ledger = Arc::new(Ledger::default());
    let month = Month::now();
    ledger.set(1, month, 100);
    let a = RedisLimiter::connect(&url, "fleetgate-test:restart", ledger.clone()).unwrap();
    let b = Arc::new(
        RedisLimiter::connect_with(
            &url,
            "fleetgate-test:restart",
            ledger.clone(),
            RedisLimiterOptions {
                poll_interval: Duration::from_secs(60),
                ..RedisLimiterOptions::default()
            },
        )
        .unwrap(),
    );
    let limits = limits(1000, 600, 1, 4);
    let each = cost(10, 1, 10);

    let mut server = RedisServer::start(port).await;
    let g = running(a.admit(1, &limits, &each, "a").await);
    assert_eq!(a.usage(1, month).await.unwrap().used, 100);
    a.finish(1, "a", &g, 5).await.unwrap();

    server.kill();
    expect_unavailable("admit", a.admit(1, &limits, &each, "b")).await;
    expect_unavailable("usage", a.usage(1, month)).await;

    ledger.set(1, month, 500);
    let _server = RedisServer::start(port).await;
    // The first call may still find the dropped connection; the next ones reconnect.
    let mut outcome = a.admit(1, &limits, &each, "c").await;
    for _ in 0..3 {
        if !matches!(outcome, Err(Denial::Unavailable(_))) {
            break;
        }
        outcome = a.admit(1, &limits, &each, "c").await;
    }
    let c = running(outcome);
    assert_eq!(
        a.usage(1, month).await.unwrap(),
        Usage {
            used: 500,
            reserved: c.reserved
        }
    );
    // b's waiter is woken through its resubscribed channel.
    queued(b.admit(1, &limits, &each, "d").await);
    let d = {
        let b = b.clone();
        tokio::spawn(async move { b.wait_turn(1, &limits, &each, "d").await })
    };
    a.finish(1, "c", &c, 1).await.unwrap();
    let d = soon("the waiter starts after the restart", d)
        .await
        .unwrap()
        .unwrap();
    b.finish(1, "d", &d, 1).await.unwrap();
}

/// A Redis with a password, and the limiter on a database other than 0: its
/// connections authenticate and select that database (the scripts' as well as the
/// seeding's, or the counter the one seeds would never be the one the scripts read); a
/// wrong password refuses every call, as a Redis that is down does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server on PATH"]
async fn authenticates_and_selects_its_database() {
    let port = free_port();
    let base = format!("redis://:s3cret@127.0.0.1:{port}");
    let _server = RedisServer::start_with(port, &["--requirepass", "s3cret"], &base).await;
    let ledger = Arc::new(Ledger::default());
    let month = Month::now();
    ledger.set(1, month, 100);
    let limiter =
        RedisLimiter::connect(&format!("{base}/2"), "fleetgate-test:auth", ledger.clone()).unwrap();
    let limits = limits(1000, 600, 1, 4);
    let grant = running(limiter.admit(1, &limits, &cost(10, 1, 10), "a").await);
    limiter.finish(1, "a", &grant, 5).await.unwrap();
    assert_eq!(limiter.usage(1, month).await.unwrap().used, 105);

    let counter = limiter.counter_key(1, month);
    let read = |db: u32| {
        let client = redis::Client::open(format!("{base}/{db}")).unwrap();
        let mut connection = client.get_connection().unwrap();
        redis::cmd("GET")
            .arg(&counter)
            .query::<Option<u64>>(&mut connection)
            .unwrap()
    };
    assert_eq!(read(2), Some(105), "the counter is in database 2");
    assert_eq!(read(0), None, "and nothing in database 0");

    let wrong = RedisLimiter::connect(
        &format!("redis://:wrong@127.0.0.1:{port}/2"),
        "fleetgate-test:auth",
        ledger,
    )
    .unwrap();
    every_call_is_unavailable(&wrong, 1).await;
}

/// The fair queue's service counts: each replica adds what it served, and gets every
/// key's total over all replicas back; with one process there is nothing to share.
async fn replicas_share_their_service_counts(fixture: Fixture) {
    let local = Fixture::local().limiter();
    assert_eq!(
        local.exchange_service("m", &[(1, 5.0)]).await.unwrap(),
        None
    );
    let (a, b) = (fixture.limiter(), fixture.limiter());
    let sorted = |mut totals: Vec<(i64, f64)>| {
        totals.sort_by_key(|(key, _)| *key);
        totals
    };
    let first = a.exchange_service("m", &[(1, 100.0), (2, 2.5)]).await;
    assert_eq!(sorted(first.unwrap().unwrap()), [(1, 100.0), (2, 2.5)]);
    let second = b.exchange_service("m", &[(1, 50.0)]).await;
    assert_eq!(sorted(second.unwrap().unwrap()), [(1, 150.0), (2, 2.5)]);
    let other_model = a.exchange_service("n", &[]).await;
    assert_eq!(other_model.unwrap().unwrap(), []);
}

// ---------------------------------------------------------------------------------------
// Instantiation
// ---------------------------------------------------------------------------------------

macro_rules! limiter_tests {
    (shared: [$($shared:ident),* $(,)?], redis_only: [$($only:ident),* $(,)?] $(,)?) => {
        mod local_limiter {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $shared() {
                    super::$shared(super::Fixture::local()).await;
                }
            )*
        }

        mod redis_limiter {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                #[ignore = "needs Redis (set TEST_REDIS_URL)"]
                async fn $shared() {
                    super::$shared(super::Fixture::redis(stringify!($shared))).await;
                }
            )*
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                #[ignore = "needs Redis (set TEST_REDIS_URL)"]
                async fn $only() {
                    super::$only(super::Fixture::redis(stringify!($only))).await;
                }
            )*
        }
    };
}

limiter_tests! {
    shared: [
        budget_is_never_exceeded_under_concurrency,
        clamp_fits_the_remaining_budget,
        counters_are_seeded_from_the_ledger,
        queue_is_fifo_and_bounded,
        admit_does_not_overtake_the_queue,
        budget_refusal_at_the_turn_leaves_the_queue,
        finish_and_leave_are_idempotent,
        rate_allows_a_burst_then_limits,
        refusals_count_against_the_rate,
        a_peek_refuses_as_admit_would_and_takes_nothing,
        a_counted_start_shares_the_rate_and_takes_nothing_else,
    ],
    redis_only: [
        waiters_wake_across_replicas,
        leases_of_a_crashed_replica_expire,
        a_reservation_left_without_its_slot_set_is_set_aside,
        reservations_without_their_bookkeeping_are_counted,
        replicas_share_their_service_counts,
    ],
}
