//! The in-memory key table: known keys answered without the store, a flood of unknown
//! keys costing the store nothing beyond the follow loop's own reads, keys changed
//! elsewhere picked up, and what a store outage does to hits and misses.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fleetgate::key_secret;
use fleetgate::keys::{self, FOLLOW_EVERY, KeyTable};
use fleetgate::store::{LimitOverrides, LimitUpdate, Store, StoreError};

use crate::common::{Gateway, expect_error};
use crate::store::{TestDb, WatchedStore};

async fn watched() -> (TestDb, Arc<WatchedStore>) {
    let db = TestDb::sqlite();
    let (store, _appends) = WatchedStore::new(db.store().await, 0);
    (db, store)
}

/// The table over `store`, following its feed as `serve` has it follow (until the
/// test's runtime ends).
async fn followed(store: &Arc<WatchedStore>) -> Arc<KeyTable> {
    let table = KeyTable::load(store.clone()).await.unwrap();
    tokio::spawn(Arc::clone(&table).follow(tokio_util::sync::CancellationToken::new()));
    table
}

fn reads(store: &WatchedStore) -> u32 {
    store.feed_reads.load(Ordering::SeqCst)
}

/// A random well-formed prefix that matches no key.
fn unknown_prefix() -> String {
    key_secret::generate().prefix
}

#[tokio::test]
async fn known_keys_are_answered_from_memory_even_with_the_store_down() {
    let (_db, store) = watched().await;
    let key = key_secret::generate();
    let record = store
        .create_key("k", None, &key, &LimitOverrides::default())
        .await
        .unwrap();
    let table = KeyTable::load(store.clone()).await.unwrap();
    let loaded = reads(&store);
    for _ in 0..1_000 {
        let found = table.find(&key.prefix).await.unwrap().unwrap();
        assert_eq!(*found, record);
    }
    assert_eq!(reads(&store), loaded, "a hit never reads the store");
    tokio::spawn(Arc::clone(&table).follow(tokio_util::sync::CancellationToken::new()));

    store.feed_down.store(true, Ordering::SeqCst);
    assert_eq!(*table.find(&key.prefix).await.unwrap().unwrap(), record);
    // A prefix the table does not know cannot be told apart from a key created a
    // moment ago while the store is away: unavailable, not unknown.
    assert!(matches!(
        table.find(&unknown_prefix()).await,
        Err(StoreError::Unavailable)
    ));
    store.feed_down.store(false, Ordering::SeqCst);
    answers_again(&table).await;
}

/// Once the store answers again, so does the table: a miss is told "unknown" as soon as
/// a pull succeeds (one that began while the store was away may still fail first).
async fn answers_again(table: &KeyTable) {
    let back = Instant::now();
    loop {
        match table.find(&unknown_prefix()).await {
            Ok(None) => return,
            Err(StoreError::Unavailable) if back.elapsed() < keys::MISS_WAIT => {}
            other => panic!("{other:?} {:?} after the store came back", back.elapsed()),
        }
    }
}

/// A store that takes the query and never answers (a black-holed database) cannot
/// hold a request with an unknown key: it is refused as unavailable once the pull's
/// time-out has passed, and the table answers again once the store does.
#[tokio::test]
async fn a_miss_is_answered_within_the_pull_time_out_when_the_store_goes_silent() {
    let (_db, store) = watched().await;
    let table = followed(&store).await;
    store.feed_stalled.store(true, Ordering::SeqCst);
    let asked = Instant::now();
    let found = tokio::time::timeout(Duration::from_secs(10), table.find(&unknown_prefix()))
        .await
        .expect("a miss is answered although the store is silent");
    assert!(matches!(found, Err(StoreError::Unavailable)), "{found:?}");
    assert!(asked.elapsed() < FOLLOW_EVERY + keys::PULL_TIMEOUT + Duration::from_secs(1));
    store.feed_stalled.store(false, Ordering::SeqCst);
    answers_again(&table).await;
}

/// Unknown prefixes (and malformed keys) make no store query of their own: during a
/// flood the store is read exactly as often as without one, by the follow loop alone.
#[tokio::test]
async fn a_flood_of_unknown_keys_makes_no_store_reads() {
    let (_db, store) = watched().await;
    let table = followed(&store).await;

    // 2,000 at once, then a steady flood for a second from 32 clients.
    let before = reads(&store);
    let started = Instant::now();
    let misses: Vec<_> = (0..2_000)
        .map(|_| {
            let table = Arc::clone(&table);
            tokio::spawn(async move { table.find(&unknown_prefix()).await })
        })
        .collect();
    for miss in misses {
        assert!(miss.await.unwrap().unwrap().is_none());
    }
    let workers: Vec<_> = (0..32)
        .map(|_| {
            let table = Arc::clone(&table);
            tokio::spawn(async move {
                let mut asked = 0u32;
                while started.elapsed() < Duration::from_secs(1) {
                    assert!(table.find(&unknown_prefix()).await.unwrap().is_none());
                    assert!(key_secret::parse_bearer("fg-not-a-key").is_none());
                    asked += 1;
                }
                asked
            })
        })
        .collect();
    let mut asked = 0;
    for worker in workers {
        asked += worker.await.unwrap();
    }
    let elapsed = started.elapsed();
    let flood = reads(&store) - before;
    // The follow loop's ticks in that time, plus the one under way at each end.
    let ticks = u32::try_from(elapsed.as_millis() / FOLLOW_EVERY.as_millis()).unwrap() + 2;
    assert!(
        flood <= ticks,
        "{} misses in {elapsed:?} read the feed {flood} times (the follow loop alone: {ticks})",
        2_000 + asked
    );
    assert!(asked >= 32, "every client was answered: {asked} misses");
}

#[tokio::test]
async fn a_key_created_or_changed_elsewhere_is_seen() {
    let (_db, store) = watched().await;
    let table = followed(&store).await;
    // Created after the table was loaded: found on first use, by the pull that follows
    // the miss.
    let key = key_secret::generate();
    let record = store
        .create_key("late", None, &key, &LimitOverrides::default())
        .await
        .unwrap();
    assert_eq!(*table.find(&key.prefix).await.unwrap().unwrap(), record);
    // Changed: a table has it after its next pull (one that does not follow by itself,
    // to see the change arrive).
    let table = KeyTable::load(store.clone()).await.unwrap();
    let limited = store
        .set_limits(
            &key.prefix,
            &LimitUpdate {
                max_queued: Some(Some(7)),
                ..LimitUpdate::default()
            },
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(table.get(&key.prefix).unwrap().limits.max_queued, None);
    table.pull().await.unwrap();
    assert_eq!(*table.get(&key.prefix).unwrap(), limited);
}

/// The running gateway follows the feed by itself: a revocation and a limit change made
/// by another process's store handle (as the CLI makes them) take effect within 1 s.
#[tokio::test]
async fn the_gateway_sees_a_revocation_and_a_limit_change_from_elsewhere_within_a_second() {
    let gw = Gateway::start().await;
    let body =
        r#"{"model":"MODEL","prompt":"Hi","max_tokens":2}"#.replace("MODEL", crate::common::MODEL);
    assert_eq!(gw.complete(&body).send().await.unwrap().status(), 200);
    let elsewhere = fleetgate::store::connect(&format!("sqlite://{}", gw.db_path().display()))
        .await
        .unwrap();

    elsewhere
        .set_limits(
            &gw.key[..12],
            &LimitUpdate {
                monthly_budget: Some(Some(1)),
                ..LimitUpdate::default()
            },
        )
        .await
        .unwrap()
        .unwrap();
    let took = until_refused(&gw, &body, "budget_exceeded").await;
    assert!(took < Duration::from_secs(1), "the budget took {took:?}");

    elsewhere.revoke_key(&gw.key[..12]).await.unwrap().unwrap();
    let took = until_refused(&gw, &body, "invalid_api_key").await;
    assert!(
        took < Duration::from_secs(1),
        "the revocation took {took:?}"
    );
    expect_error(
        gw.complete(&body).send().await.unwrap(),
        401,
        "invalid_api_key",
    )
    .await;
}

/// Sends the request until it is refused with `code` (at most 5 s); how long that took.
async fn until_refused(gw: &Gateway, body: &str, code: &str) -> Duration {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        let response = gw.complete(body).send().await.unwrap();
        if response.status() != 200 {
            let error: serde_json::Value = response.json().await.unwrap();
            if error["error"]["code"] == code {
                return started.elapsed();
            }
        }
    }
    panic!("never refused with {code}");
}
