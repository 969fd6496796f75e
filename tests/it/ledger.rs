//! The usage ledger's write-behind writer: group commit, nothing dropped while the store
//! is away (retried until it is back), the backlog bound, and a close that writes
//! everything.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fleetgate::backoff::Backoff;
use fleetgate::key_secret;
use fleetgate::ledger::{Ledger, LedgerConfig};
use fleetgate::store::{LimitOverrides, Store, UsageRow};

use crate::store::{TestDb, WatchedStore};

const MONTH: &str = "2026-12";

async fn setup() -> (TestDb, Arc<WatchedStore>, i64) {
    let db = TestDb::sqlite();
    let (store, _appends) = WatchedStore::new(db.store().await, 0);
    let key = store
        .create_key(
            "k",
            None,
            &key_secret::generate(),
            &LimitOverrides::default(),
        )
        .await
        .unwrap();
    (db, store, key.id)
}

fn row(key_id: i64, n: usize) -> UsageRow {
    UsageRow {
        key_id,
        request_id: format!("req_{n}"),
        month: MONTH.to_owned(),
        prompt_tokens: 2,
        completion_tokens: 1,
        created_at: 0,
    }
}

fn config(backlog_limit: usize) -> LedgerConfig {
    LedgerConfig {
        batch_rows: 100,
        max_delay: Duration::from_millis(20),
        backlog_limit,
        retry: Backoff::new(Duration::from_millis(10), Duration::from_millis(50)),
    }
}

#[tokio::test]
async fn rows_are_committed_in_batches_and_a_flush_waits_for_them() {
    let (_db, store, key) = setup().await;
    let ledger = Ledger::start_with(store.clone(), config(10_000));
    for n in 0..1_000 {
        ledger.record(row(key, n));
    }
    ledger.flush().await;
    assert_eq!(store.month_usage(key, MONTH).await.unwrap(), 3_000);
    let writes = store.usage_writes.load(Ordering::SeqCst);
    assert!(
        (10..=20).contains(&writes),
        "1,000 rows in batches of 100: {writes} transactions"
    );
    let stats = ledger.stats();
    assert_eq!((stats.written, stats.pending, stats.lost), (1_000, 0, 0));
}

#[tokio::test]
async fn a_row_waits_at_most_the_delay_for_its_batch() {
    let (_db, store, key) = setup().await;
    let ledger = Ledger::start_with(store.clone(), config(10_000));
    ledger.record(row(key, 1));
    // No flush: the writer commits the lone row once it has waited max_delay.
    let committed = tokio::time::timeout(Duration::from_secs(2), async {
        while ledger.stats().written == 0 {
            tokio::task::yield_now().await;
        }
    });
    committed.await.expect("committed within the delay");
    assert_eq!(store.month_usage(key, MONTH).await.unwrap(), 3);
}

#[tokio::test]
async fn rows_wait_while_the_store_is_away_and_none_is_lost() {
    let (_db, store, key) = setup().await;
    let ledger = Ledger::start_with(store.clone(), config(50));
    store.usage_down.store(true, Ordering::SeqCst);
    for n in 0..60 {
        ledger.record(row(key, n));
    }
    // The writer keeps trying; the rows stay pending and the backlog bound is reached.
    let tried = store.usage_writes.load(Ordering::SeqCst);
    let retried = tokio::time::timeout(Duration::from_secs(5), async {
        while store.usage_writes.load(Ordering::SeqCst) < tried + 3 {
            tokio::task::yield_now().await;
        }
    });
    retried.await.expect("the writer retries");
    assert_eq!(ledger.stats().pending, 60);
    assert!(ledger.backlogged(), "60 rows waiting, limit 50");
    assert_eq!(store.month_usage(key, MONTH).await.unwrap(), 0);

    store.usage_down.store(false, Ordering::SeqCst);
    ledger.flush().await;
    assert_eq!(store.month_usage(key, MONTH).await.unwrap(), 180);
    assert!(!ledger.backlogged());
    let stats = ledger.stats();
    assert_eq!((stats.written, stats.pending, stats.lost), (60, 0, 0));
}

#[tokio::test]
async fn close_writes_everything_queued() {
    let (_db, store, key) = setup().await;
    let mut slow = config(10_000);
    // A delay far longer than the test: only close can write these rows.
    slow.max_delay = Duration::from_secs(3_600);
    let ledger = Ledger::start_with(store.clone(), slow);
    for n in 0..250 {
        ledger.record(row(key, n));
    }
    let stats = ledger.close(Duration::from_secs(5)).await;
    assert_eq!((stats.written, stats.pending, stats.lost), (250, 0, 0));
    assert_eq!(store.month_usage(key, MONTH).await.unwrap(), 750);
}

#[tokio::test]
async fn a_row_the_store_refuses_is_given_up_without_holding_back_the_others() {
    let (_db, store, key) = setup().await;
    let ledger = Ledger::start_with(store.clone(), config(10_000));
    ledger.record(row(key, 1));
    ledger.record(UsageRow {
        month: "2026-13".to_owned(),
        ..row(key, 2)
    });
    ledger.record(row(key, 3));
    ledger.flush().await;
    assert_eq!(store.month_usage(key, MONTH).await.unwrap(), 6);
    let stats = ledger.stats();
    assert_eq!((stats.written, stats.pending, stats.lost), (2, 0, 1));
}

#[tokio::test]
async fn close_ends_within_its_deadline_while_the_store_is_away() {
    let (_db, store, key) = setup().await;
    let ledger = Ledger::start_with(store.clone(), config(10_000));
    store.usage_down.store(true, Ordering::SeqCst);
    for n in 0..10 {
        ledger.record(row(key, n));
    }
    let closing = tokio::time::timeout(
        Duration::from_secs(5),
        ledger.close(Duration::from_millis(200)),
    );
    let stats = closing
        .await
        .expect("close returns soon after its deadline");
    assert_eq!((stats.written, stats.pending), (0, 10));
}

#[tokio::test]
async fn a_row_breaking_a_constraint_is_given_up_too() {
    let (_db, store, key) = setup().await;
    let ledger = Ledger::start_with(store.clone(), config(10_000));
    ledger.record(row(key, 1));
    // No such key: the foreign key refuses it, for ever.
    ledger.record(row(key + 1_000, 2));
    ledger.record(row(key, 3));
    ledger.flush().await;
    assert_eq!(store.month_usage(key, MONTH).await.unwrap(), 6);
    let stats = ledger.stats();
    assert_eq!((stats.written, stats.pending, stats.lost), (2, 0, 1));
}
