//! A model's scale-to-zero state: its wake and sleep hooks, whether it is asleep or
//! booting, and the activity the keep-warm policy decides on. The hook calls that change
//! it are in `wake.rs`.
//!
//! The keep-warm policy: with a sleep hook (`sleep_url`), an idle model is put to sleep
//! once nothing is in flight or queued, no request came for `idle_sleep_ms` and no
//! `X-Acs-Workload: interactive` request for `keep_warm_ms`. Batch traffic wakes a
//! sleeping model like any other but keeps it awake only for the shorter idle period.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::ModelConfig;

pub struct Sleep {
    pub(super) wake_url: Option<String>,
    pub(super) sleep_url: Option<String>,
    pub boot_timeout: Duration,
    keep_warm: Duration,
    idle_sleep: Duration,
    pub(super) asleep: AtomicBool,
    /// Held while a wake or sleep hook is called: one hook call at a time per model.
    pub(super) hook: tokio::sync::Mutex<()>,
    /// When the boot under way was confirmed; requests that find the model down within
    /// the boot timeout join it instead of calling the hook again. (A plain mutex, never
    /// held across an await: the prober reads it without waiting for a hook call.)
    booting: Mutex<Option<Instant>>,
    /// Wake hook calls so far, and whether the last one failed: requests that queued
    /// behind a failed call share its failure instead of calling again one by one.
    pub(super) wake_calls: AtomicU64,
    pub(super) last_wake_failed: AtomicBool,
    activity: Mutex<Activity>,
}

#[derive(Clone, Copy)]
pub(super) struct Activity {
    pub(super) last_request: Instant,
    last_interactive: Option<Instant>,
}

impl Sleep {
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            wake_url: config.wake_url.clone(),
            sleep_url: config.sleep_url.clone(),
            boot_timeout: Duration::from_millis(config.boot_timeout_ms),
            keep_warm: Duration::from_millis(config.keep_warm_ms),
            idle_sleep: Duration::from_millis(config.idle_sleep_ms),
            asleep: AtomicBool::new(false),
            hook: tokio::sync::Mutex::new(()),
            booting: Mutex::new(None),
            wake_calls: AtomicU64::new(0),
            last_wake_failed: AtomicBool::new(false),
            activity: Mutex::new(Activity {
                last_request: Instant::now(),
                last_interactive: None,
            }),
        }
    }

    /// Whether the model can be woken when no node is up.
    pub fn can_wake(&self) -> bool {
        self.wake_url.is_some()
    }

    pub fn is_asleep(&self) -> bool {
        self.asleep.load(Ordering::Acquire)
    }

    pub(super) fn activity(&self) -> std::sync::MutexGuard<'_, Activity> {
        self.activity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn booting(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.booting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a confirmed boot is under way (within the boot timeout).
    pub fn is_booting(&self) -> bool {
        self.booting()
            .is_some_and(|started| started.elapsed() < self.boot_timeout)
    }

    /// A request for the model arrived; `interactive` ones keep it warm longer.
    pub fn touch(&self, interactive: bool) {
        let now = Instant::now();
        let mut activity = self.activity();
        activity.last_request = now;
        if interactive {
            activity.last_interactive = Some(now);
        }
    }

    /// Whether the keep-warm policy lets the model sleep now.
    pub(super) fn idle(&self, now: Instant) -> bool {
        let activity = *self.activity();
        now.duration_since(activity.last_request) >= self.idle_sleep
            && activity
                .last_interactive
                .is_none_or(|t| now.duration_since(t) >= self.keep_warm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sleep(keep_warm_ms: u64, idle_sleep_ms: u64) -> Sleep {
        let config: crate::config::Config = crate::config::Config::from_toml(&format!(
            r#"
[[models]]
id = "m"
wake_url = "http://127.0.0.1:1/wake"
sleep_url = "http://127.0.0.1:1/sleep"
keep_warm_ms = {keep_warm_ms}
idle_sleep_ms = {idle_sleep_ms}
[[models.upstreams]]
url = "http://127.0.0.1:1"
gpu = "g"
"#
        ))
        .unwrap();
        Sleep::new(&config.models[0])
    }

    #[test]
    fn interactive_traffic_keeps_a_model_warm_longer_than_batch() {
        let s = sleep(60_000, 1_000);
        let now = Instant::now();
        assert!(!s.idle(now), "just started: not idle yet");
        assert!(s.idle(now + Duration::from_secs(2)));
        s.touch(false);
        assert!(
            s.idle(Instant::now() + Duration::from_secs(2)),
            "batch keeps it 1 s"
        );
        s.touch(true);
        assert!(!s.idle(Instant::now() + Duration::from_secs(2)));
        assert!(s.idle(Instant::now() + Duration::from_secs(61)));
    }
}
