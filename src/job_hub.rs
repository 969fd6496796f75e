//! What the job handlers and workers of one replica share: the long-polls waiting for a
//! job to end, the jobs running here (so a cancel reaches them at once), and the signal
//! that wakes an idle worker when a job is queued here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::JobSettings;

/// The replica's job hub; cheap to clone.
#[derive(Clone)]
pub struct JobHub(Arc<Inner>);

struct Inner {
    /// Names this replica's claims (`lease_owner`): for the operator, not for fencing.
    owner: String,
    max_waiters: u32,
    max_waiters_per_key: u32,
    waiting: Mutex<Waiting>,
    /// Per job running here: its attempt and what stops its run.
    running: Mutex<HashMap<String, (i64, CancellationToken)>>,
    queued: Notify,
    stopping: CancellationToken,
}

#[derive(Default)]
struct Waiting {
    /// Per job id: the long-polls' shared signal and how many wait on it.
    jobs: HashMap<String, (Arc<Notify>, u32)>,
    per_key: HashMap<i64, u32>,
    total: u32,
}

/// Too many long-polls wait already (on this replica, or for this key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Declined;

impl JobHub {
    pub fn new(settings: &JobSettings) -> Self {
        Self(Arc::new(Inner {
            owner: format!("replica_{}", uuid::Uuid::new_v4().simple()),
            max_waiters: settings.max_waiters,
            max_waiters_per_key: settings.max_waiters_per_key,
            waiting: Mutex::new(Waiting::default()),
            running: Mutex::new(HashMap::new()),
            queued: Notify::new(),
            stopping: CancellationToken::new(),
        }))
    }

    /// Cancelled when the replica starts shutting down: long-polls answer at once.
    pub fn stopping(&self) -> &CancellationToken {
        &self.0.stopping
    }

    pub fn owner(&self) -> &str {
        &self.0.owner
    }

    fn waiting(&self) -> MutexGuard<'_, Waiting> {
        self.0.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn running(&self) -> MutexGuard<'_, HashMap<String, (i64, CancellationToken)>> {
        self.0.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place among the long-polls waiting for job `id` of `key`, within the bounds.
    pub fn wait_for(&self, key: i64, id: &str) -> Result<Waiter, Declined> {
        let mut waiting = self.waiting();
        let per_key = waiting.per_key.get(&key).copied().unwrap_or(0);
        if waiting.total >= self.0.max_waiters || per_key >= self.0.max_waiters_per_key {
            return Err(Declined);
        }
        waiting.total += 1;
        *waiting.per_key.entry(key).or_insert(0) += 1;
        let entry = waiting
            .jobs
            .entry(id.to_owned())
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        Ok(Waiter {
            hub: self.clone(),
            key,
            id: id.to_owned(),
            ended: Arc::clone(&entry.0),
        })
    }

    /// Wakes the long-polls waiting for job `id` (it ended).
    pub fn ended(&self, id: &str) {
        if let Some((notify, _)) = self.waiting().jobs.get(id) {
            notify.notify_waiters();
        }
    }

    /// The jobs long-polls wait for, to ask the store which ended elsewhere.
    pub fn awaited(&self) -> Vec<String> {
        self.waiting().jobs.keys().cloned().collect()
    }

    /// Marks `attempt` of job `id` as running here; `cancel` stops its run.
    pub fn running_here(&self, id: &str, attempt: i64, cancel: CancellationToken) {
        self.running().insert(id.to_owned(), (attempt, cancel));
    }

    /// `attempt` of job `id` has stopped (a later attempt of it here stays marked).
    pub fn not_running_here(&self, id: &str, attempt: i64) {
        let mut running = self.running();
        if running.get(id).is_some_and(|(a, _)| *a == attempt) {
            running.remove(id);
        }
    }

    /// Stops the run of job `id` if it runs here.
    pub fn cancel_here(&self, id: &str) {
        if let Some((_, cancel)) = self.running().get(id) {
            cancel.cancel();
        }
    }

    /// A job was queued here: an idle worker takes it without waiting for its poll.
    pub fn job_queued(&self) {
        self.0.queued.notify_one();
    }

    /// Resolves when [`JobHub::job_queued`] is called (or was, since the last wait).
    pub async fn next_queued(&self) {
        self.0.queued.notified().await;
    }
}

/// A long-poll's place; dropping it gives the place back.
pub struct Waiter {
    hub: JobHub,
    key: i64,
    id: String,
    ended: Arc<Notify>,
}

impl Waiter {
    /// The signal of the job's end. Create the `notified()` future (and `enable` it)
    /// before reading the job's state, so an end between the read and the wait is seen.
    pub fn ended(&self) -> &Notify {
        &self.ended
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut waiting = self.hub.waiting();
        waiting.total = waiting.total.saturating_sub(1);
        if let Some(n) = waiting.per_key.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                waiting.per_key.remove(&self.key);
            }
        }
        if let Some(entry) = waiting.jobs.get_mut(&self.id) {
            entry.1 = entry.1.saturating_sub(1);
            if entry.1 == 0 {
                waiting.jobs.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(max: u32, per_key: u32) -> JobHub {
        JobHub::new(&JobSettings {
            max_waiters: max,
            max_waiters_per_key: per_key,
            ..JobSettings::default()
        })
    }

    #[test]
    fn waiters_are_bounded_overall_and_per_key_and_give_their_place_back() {
        let hub = hub(3, 2);
        let a1 = hub.wait_for(1, "job_a").unwrap();
        let _a2 = hub.wait_for(1, "job_b").unwrap();
        assert_eq!(hub.wait_for(1, "job_c").err(), Some(Declined));
        let _b1 = hub.wait_for(2, "job_d").unwrap();
        assert_eq!(hub.wait_for(3, "job_e").err(), Some(Declined));
        drop(a1);
        assert!(hub.wait_for(1, "job_c").is_ok());
        assert!(!hub.awaited().contains(&"job_a".to_owned()));
    }

    #[tokio::test]
    async fn an_end_wakes_every_waiter_of_that_job_only() {
        let hub = hub(10, 10);
        let first = hub.wait_for(1, "job_a").unwrap();
        let second = hub.wait_for(1, "job_a").unwrap();
        let other = hub.wait_for(1, "job_b").unwrap();
        let (f, s, o) = (
            first.ended().notified(),
            second.ended().notified(),
            other.ended().notified(),
        );
        tokio::pin!(f, s, o);
        f.as_mut().enable();
        s.as_mut().enable();
        o.as_mut().enable();
        hub.ended("job_a");
        f.await;
        s.await;
        assert!(futures_util::poll!(o).is_pending());
    }
}
