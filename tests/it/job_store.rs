//! The job store (`jobs` table), one suite for both backends: ownership, idempotency
//! keys, fenced claims and lease takeover, cancels, paging and retention. The
//! PostgreSQL variants are ignored by default (see `store.rs` for how to run them).

use std::collections::HashSet;
use std::sync::Arc;

use fleetgate::store::{
    Inserted, JobOutcome, JobQuery, JobStatus, LimitOverrides, NewJob, Retention, Store, Swept,
    UsageRow,
};

/// A moment far from the real clock: the store takes every time from its arguments.
const T0: i64 = 1_800_000_000_000;
const DAY: i64 = 24 * 3_600_000;

fn job(key_id: i64, n: u32, idempotency_key: Option<&str>) -> NewJob {
    NewJob {
        id: format!("job_{n:04}"),
        key_id,
        model: "llama-8b".to_owned(),
        idempotency_key: idempotency_key.map(str::to_owned),
        request_hash: vec![n as u8; 32],
        request: format!("{{\"prompt\":\"p{n}\"}}").into_bytes(),
        created_at_ms: T0,
        expires_at_ms: T0 + DAY,
    }
}

fn succeeded() -> JobOutcome {
    JobOutcome {
        status: JobStatus::Succeeded,
        result: Some(b"{\"id\":\"cmpl-1\"}".to_vec()),
        result_status: Some(200),
        error_code: None,
        prompt_tokens: Some(3),
        completion_tokens: Some(5),
        charge: None,
    }
}

macro_rules! job_store_tests {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $test() {
                    let db = crate::store::TestDb::sqlite();
                    super::$test(db.store().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                #[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
                async fn $test() {
                    let db = crate::store::TestDb::postgres().await;
                    super::$test(db.store().await).await;
                }
            )*
        }
    };
}

job_store_tests![
    a_job_belongs_to_its_key,
    an_idempotency_key_names_one_job_per_key,
    a_claim_is_a_fenced_attempt,
    a_lapsed_lease_is_taken_over_by_a_new_attempt,
    an_end_and_its_charge_commit_together_once,
    a_requeued_job_waits_until_it_is_due,
    cancel_ends_a_queued_job_and_flags_a_running_one,
    concurrent_claimers_never_share_a_job,
    retention_expires_purges_and_deletes,
    pages_are_newest_first_and_filter_by_status,
];

/// A key of the store's own: the ledger's rows name one.
async fn new_key(store: &dyn Store) -> i64 {
    let key = fleetgate::key_secret::generate();
    store
        .create_key("k", None, &key, &LimitOverrides::default())
        .await
        .unwrap()
        .id
}

async fn insert(store: &dyn Store, job: &NewJob) -> fleetgate::store::JobRow {
    match store.jobs().insert(job).await.unwrap() {
        Inserted::Created(row) => row,
        Inserted::Existing(row) => panic!("{} already existed", row.id),
    }
}

async fn a_job_belongs_to_its_key(store: Arc<dyn Store>) {
    let row = insert(&*store, &job(1, 1, None)).await;
    assert_eq!(row.status(), JobStatus::Queued);
    assert_eq!(row.attempts, 0);
    let jobs = store.jobs();
    assert_eq!(jobs.job(1, "job_0001").await.unwrap(), Some(row.clone()));
    assert_eq!(jobs.job(2, "job_0001").await.unwrap(), None);
    assert_eq!(jobs.cancel(2, "job_0001", T0).await.unwrap(), None);
    assert_eq!(jobs.pending(1).await.unwrap().jobs, 1);
    assert_eq!(jobs.pending(2).await.unwrap().jobs, 0);
    assert!(
        jobs.list(&JobQuery {
            key_id: Some(2),
            limit: 10,
            ..JobQuery::default()
        })
        .await
        .unwrap()
        .is_empty()
    );
}

async fn an_idempotency_key_names_one_job_per_key(store: Arc<dyn Store>) {
    let first = insert(&*store, &job(1, 1, Some("retry-me"))).await;
    let jobs = store.jobs();
    match jobs.insert(&job(1, 2, Some("retry-me"))).await.unwrap() {
        Inserted::Existing(row) => assert_eq!(row.id, first.id),
        Inserted::Created(row) => panic!("a second job {} under the same key", row.id),
    }
    // Another API key may use the same idempotency key for a job of its own.
    insert(&*store, &job(2, 3, Some("retry-me"))).await;
    assert_eq!(
        jobs.by_idempotency_key(1, "retry-me")
            .await
            .unwrap()
            .map(|r| r.id),
        Some(first.id)
    );
    assert_eq!(jobs.pending(1).await.unwrap().jobs, 1);
}

async fn a_claim_is_a_fenced_attempt(store: Arc<dyn Store>) {
    insert(&*store, &job(1, 1, None)).await;
    let jobs = store.jobs();
    let claimed = jobs.claim("a", T0, 30_000).await.unwrap().unwrap();
    assert_eq!(
        (claimed.status(), claimed.attempts),
        (JobStatus::Running, 1)
    );
    assert_eq!(claimed.started_at_ms, Some(T0));
    assert_eq!(claimed.lease_until_ms, Some(T0 + 30_000));
    // Nothing else is runnable while the lease runs.
    assert!(jobs.claim("b", T0 + 1_000, 30_000).await.unwrap().is_none());
    assert_eq!(
        jobs.renew("job_0001", 1, T0 + 60_000).await.unwrap(),
        Some(false)
    );
    // Another attempt's number changes nothing.
    assert!(
        !jobs
            .finish("job_0001", 2, &succeeded(), T0 + 2_000)
            .await
            .unwrap()
    );
    assert!(!jobs.requeue("job_0001", 0, T0, T0).await.unwrap());
    assert!(
        jobs.finish("job_0001", 1, &succeeded(), T0 + 2_000)
            .await
            .unwrap()
    );
    // Ended: once.
    assert!(
        !jobs
            .finish("job_0001", 1, &succeeded(), T0 + 3_000)
            .await
            .unwrap()
    );
    let row = jobs.job(1, "job_0001").await.unwrap().unwrap();
    assert_eq!(row.status(), JobStatus::Succeeded);
    assert_eq!(row.finished_at_ms, Some(T0 + 2_000));
    assert_eq!(row.result.as_deref(), Some(&b"{\"id\":\"cmpl-1\"}"[..]));
    assert_eq!(
        (row.prompt_tokens, row.completion_tokens),
        (Some(3), Some(5))
    );
    assert_eq!(row.lease_owner, None);
    assert_eq!(
        jobs.ended(&["job_0001".to_owned(), "job_9999".to_owned()])
            .await
            .unwrap(),
        ["job_0001"]
    );
}

async fn a_lapsed_lease_is_taken_over_by_a_new_attempt(store: Arc<dyn Store>) {
    insert(&*store, &job(1, 1, None)).await;
    let jobs = store.jobs();
    jobs.claim("dead", T0, 1_000).await.unwrap().unwrap();
    assert!(jobs.claim("b", T0 + 999, 1_000).await.unwrap().is_none());
    let taken = jobs.claim("b", T0 + 1_001, 1_000).await.unwrap().unwrap();
    assert_eq!(
        (taken.attempts, taken.lease_owner.as_deref()),
        (2, Some("b"))
    );
    assert_eq!(taken.started_at_ms, Some(T0), "the first start is kept");
    // The first worker, back from the dead, can neither renew nor end it.
    assert_eq!(jobs.renew("job_0001", 1, T0 + 5_000).await.unwrap(), None);
    assert!(
        !jobs
            .finish("job_0001", 1, &succeeded(), T0 + 2_000)
            .await
            .unwrap()
    );
    assert!(
        jobs.finish("job_0001", 2, &succeeded(), T0 + 2_000)
            .await
            .unwrap()
    );
}

async fn an_end_and_its_charge_commit_together_once(store: Arc<dyn Store>) {
    let key = new_key(&*store).await;
    insert(&*store, &job(key, 1, None)).await;
    let jobs = store.jobs();
    jobs.claim("a", T0, 30_000).await.unwrap().unwrap();
    let charge = UsageRow {
        key_id: key,
        request_id: "job_0001".to_owned(),
        month: "2027-01".to_owned(),
        prompt_tokens: 3,
        completion_tokens: 5,
        created_at: T0 / 1000,
    };
    let charged = JobOutcome {
        charge: Some(charge.clone()),
        ..succeeded()
    };
    // An earlier run of the job, cut short, recorded its prompt under the job's id.
    store
        .record_usage(&UsageRow {
            prompt_tokens: 3,
            completion_tokens: 0,
            ..charge.clone()
        })
        .await
        .unwrap();
    // A fenced-out end charges nothing.
    assert!(!jobs.finish("job_0001", 2, &charged, T0).await.unwrap());
    assert_eq!(store.month_usage(key, "2027-01").await.unwrap(), 3);
    // The end's charge replaces the cut run's row: the job is charged once, for its run.
    assert!(jobs.finish("job_0001", 1, &charged, T0).await.unwrap());
    assert_eq!(store.month_usage(key, "2027-01").await.unwrap(), 8);
    // The write-behind ledger's row of the same run, under the same id: no second charge.
    store.record_usage(&charge).await.unwrap();
    assert_eq!(store.month_usage(key, "2027-01").await.unwrap(), 8);
}

async fn a_requeued_job_waits_until_it_is_due(store: Arc<dyn Store>) {
    insert(&*store, &job(1, 1, None)).await;
    insert(&*store, &job(1, 2, None)).await;
    let jobs = store.jobs();
    // A cancel asked for while a run was under way: queuing it again ends it instead.
    jobs.claim("a", T0, 30_000).await.unwrap().unwrap();
    jobs.cancel(1, "job_0001", T0).await.unwrap();
    assert!(
        jobs.requeue("job_0001", 1, T0 + 5_000, T0 + 10)
            .await
            .unwrap()
    );
    let cancelled = jobs.job(1, "job_0001").await.unwrap().unwrap();
    assert_eq!(
        (cancelled.status(), cancelled.finished_at_ms),
        (JobStatus::Cancelled, Some(T0 + 10))
    );
    let claimed = jobs.claim("a", T0, 30_000).await.unwrap().unwrap();
    assert_eq!(claimed.id, "job_0002");
    assert!(jobs.requeue("job_0002", 1, T0 + 5_000, T0).await.unwrap());
    let row = jobs.job(1, "job_0002").await.unwrap().unwrap();
    assert_eq!((row.status(), row.lease_owner), (JobStatus::Queued, None));
    assert!(jobs.claim("a", T0 + 4_999, 30_000).await.unwrap().is_none());
    let again = jobs.claim("a", T0 + 5_000, 30_000).await.unwrap().unwrap();
    assert_eq!(again.attempts, 2);
}

async fn cancel_ends_a_queued_job_and_flags_a_running_one(store: Arc<dyn Store>) {
    insert(&*store, &job(1, 1, None)).await;
    insert(&*store, &job(1, 2, None)).await;
    let jobs = store.jobs();
    let running = jobs.claim("a", T0, 30_000).await.unwrap().unwrap();
    assert_eq!(running.id, "job_0001", "the oldest first");
    let queued = jobs.cancel(1, "job_0002", T0 + 10).await.unwrap().unwrap();
    assert_eq!(queued.status(), JobStatus::Cancelled);
    assert_eq!(queued.finished_at_ms, Some(T0 + 10));
    assert!(
        jobs.claim("a", T0 + 20, 30_000).await.unwrap().is_none(),
        "a cancelled job never runs"
    );
    let flagged = jobs.cancel(1, "job_0001", T0 + 30).await.unwrap().unwrap();
    assert_eq!(
        (flagged.status(), flagged.cancel_requested),
        (JobStatus::Running, 1)
    );
    assert_eq!(
        jobs.renew("job_0001", 1, T0 + 60_000).await.unwrap(),
        Some(true)
    );
    // Cancelling an ended job leaves it as it ended.
    let cancelled = JobOutcome {
        status: JobStatus::Cancelled,
        result: None,
        result_status: None,
        error_code: None,
        prompt_tokens: None,
        completion_tokens: None,
        charge: None,
    };
    assert!(
        jobs.finish("job_0001", 1, &cancelled, T0 + 40)
            .await
            .unwrap()
    );
    let again = jobs.cancel(1, "job_0002", T0 + 50).await.unwrap().unwrap();
    assert_eq!(again.finished_at_ms, Some(T0 + 10));
}

async fn concurrent_claimers_never_share_a_job(store: Arc<dyn Store>) {
    for n in 0..60 {
        insert(&*store, &job(1, n, None)).await;
    }
    let claimers: Vec<_> = (0..6)
        .map(|worker| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let mut mine = Vec::new();
                while let Some(job) = store
                    .jobs()
                    .claim(&format!("w{worker}"), T0, 60_000)
                    .await
                    .unwrap()
                {
                    assert_eq!(job.attempts, 1);
                    mine.push(job.id);
                }
                mine
            })
        })
        .collect();
    let mut all = Vec::new();
    for claimer in claimers {
        all.extend(claimer.await.unwrap());
    }
    let unique: HashSet<_> = all.iter().collect();
    assert_eq!((all.len(), unique.len()), (60, 60));
}

async fn retention_expires_purges_and_deletes(store: Arc<dyn Store>) {
    let jobs = store.jobs();
    // job 2 ends at T0 + 1 s, job 3 two days later; job 1 is queued and never runs.
    for n in [2, 3] {
        let mut ran = job(1, n, None);
        ran.expires_at_ms = T0 + 10 * DAY;
        insert(&*store, &ran).await;
    }
    for (id, end) in [("job_0002", T0 + 1_000), ("job_0003", T0 + 2 * DAY)] {
        let claimed = jobs.claim("a", T0, 30_000).await.unwrap().unwrap();
        assert_eq!(claimed.id, id);
        assert!(jobs.finish(id, 1, &succeeded(), end).await.unwrap());
    }
    insert(&*store, &job(1, 1, None)).await;
    let rules = |now_ms| Retention {
        now_ms,
        content_ttl_ms: DAY,
        metadata_ttl_ms: 7 * DAY,
    };
    let row = |id: &'static str| {
        let jobs = store.jobs();
        async move { jobs.job(1, id).await.unwrap() }
    };

    assert_eq!(
        jobs.sweep(rules(T0 + DAY - 1)).await.unwrap(),
        Swept::default()
    );
    let swept = jobs.sweep(rules(T0 + DAY + 1_000)).await.unwrap();
    assert_eq!(
        swept,
        Swept {
            expired: 1,
            purged: 1,
            deleted: 0
        }
    );
    let expired = row("job_0001").await.unwrap();
    assert_eq!(
        (expired.status(), expired.request),
        (JobStatus::Expired, None)
    );
    let purged = row("job_0002").await.unwrap();
    assert_eq!(
        (purged.status(), purged.request, purged.result),
        (JobStatus::Succeeded, None, None)
    );
    assert!(
        row("job_0003").await.unwrap().result.is_some(),
        "its day is not over"
    );

    let swept = jobs.sweep(rules(T0 + 8 * DAY + 1_000)).await.unwrap();
    assert_eq!(
        (swept.purged, swept.deleted),
        (1, 2),
        "job 3's content; jobs 1 and 2"
    );
    assert!(row("job_0001").await.is_none());
    assert!(row("job_0002").await.is_none());
    assert!(
        row("job_0003").await.is_some(),
        "7 days after its own end, not the others'"
    );
    assert_eq!(
        jobs.sweep(rules(T0 + 9 * DAY + 1)).await.unwrap().deleted,
        1
    );
}

async fn pages_are_newest_first_and_filter_by_status(store: Arc<dyn Store>) {
    for n in 1..=5 {
        insert(&*store, &job(1, n, None)).await;
    }
    let jobs = store.jobs();
    jobs.cancel(1, "job_0002", T0).await.unwrap();
    let page = |after: Option<&str>, status| JobQuery {
        key_id: Some(1),
        status,
        after: after.map(str::to_owned),
        limit: 2,
    };
    let ids =
        |rows: Vec<fleetgate::store::JobRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(
        ids(jobs.list(&page(None, None)).await.unwrap()),
        ["job_0005", "job_0004"]
    );
    assert_eq!(
        ids(jobs.list(&page(Some("job_0004"), None)).await.unwrap()),
        ["job_0003", "job_0002"]
    );
    assert_eq!(
        ids(jobs.list(&page(Some("job_0002"), None)).await.unwrap()),
        ["job_0001"]
    );
    assert_eq!(
        ids(jobs
            .list(&page(None, Some(JobStatus::Cancelled)))
            .await
            .unwrap()),
        ["job_0002"]
    );
    let counts = jobs.status_counts().await.unwrap();
    assert!(
        counts.contains(&(JobStatus::Queued, 4)) && counts.contains(&(JobStatus::Cancelled, 1)),
        "{counts:?}"
    );
}

/// PostgreSQL announces each job's end, with its id, in the transaction that ends it: a
/// long-poll on another replica wakes without waiting for its lookup.
#[tokio::test]
#[ignore = "needs PostgreSQL (set TEST_POSTGRES_URL)"]
async fn postgres_announces_each_jobs_end() {
    use futures_util::StreamExt as _;
    let db = crate::store::TestDb::postgres().await;
    let store = db.store().await;
    let mut ends = store.jobs().job_end_signals().await.expect("a listener");
    insert(&*store, &job(1, 1, None)).await;
    let jobs = store.jobs();
    jobs.claim("a", T0, 30_000).await.unwrap().unwrap();
    // A fenced-out end announces nothing; the real one does.
    assert!(!jobs.finish("job_0001", 2, &succeeded(), T0).await.unwrap());
    assert!(jobs.finish("job_0001", 1, &succeeded(), T0).await.unwrap());
    let announced = tokio::time::timeout(std::time::Duration::from_secs(5), ends.next())
        .await
        .expect("announced within 5 s");
    assert_eq!(announced.as_deref(), Some("job_0001"));
}
