//! Scale to zero: waking a model whose nodes are all down, and putting an idle model
//! back to sleep.
//!
//! A model may declare a wake hook (`wake_url`): when a request finds no node of the
//! model up, fleetgate `POST`s to it once (concurrent requests share the boot) and a 2xx
//! answer confirms that a boot has started. The requests then wait up to
//! `boot_timeout_ms` for the prober to see a node come up (see `completion/cold.rs` for
//! what the client sees meanwhile).
//!
//! With a sleep hook (`sleep_url`), the keep-warm policy puts an idle model to sleep:
//! nothing in flight or queued, no request at all for `idle_sleep_ms` and no
//! `X-Acs-Workload: interactive` request for `keep_warm_ms`. Batch traffic wakes a
//! sleeping model like any other but keeps it awake only for the shorter idle period.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::ModelConfig;
use crate::error::ApiError;
use crate::fleet::Model;
use crate::upstream::UpstreamClient;

/// A hook that does not answer within this is taken as failed.
const HOOK_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Sleep {
    wake_url: Option<String>,
    sleep_url: Option<String>,
    pub boot_timeout: Duration,
    keep_warm: Duration,
    idle_sleep: Duration,
    asleep: AtomicBool,
    /// Held while a wake or sleep hook is called: one hook call at a time per model.
    hook: tokio::sync::Mutex<()>,
    /// When the boot under way was confirmed; requests that find the model down within
    /// the boot timeout join it instead of calling the hook again. (A plain mutex, never
    /// held across an await: the prober reads it without waiting for a hook call.)
    booting: Mutex<Option<Instant>>,
    /// Wake hook calls so far, and whether the last one failed: requests that queued
    /// behind a failed call share its failure instead of calling again one by one.
    wake_calls: AtomicU64,
    last_wake_failed: AtomicBool,
    activity: Mutex<Activity>,
}

#[derive(Clone, Copy)]
struct Activity {
    last_request: Instant,
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

    fn activity(&self) -> std::sync::MutexGuard<'_, Activity> {
        self.activity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn booting(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
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
    fn idle(&self, now: Instant) -> bool {
        let activity = *self.activity();
        now.duration_since(activity.last_request) >= self.idle_sleep
            && activity
                .last_interactive
                .is_none_or(|t| now.duration_since(t) >= self.keep_warm)
    }
}

impl Model {
    /// Starts a boot (or joins the one under way). `Ok` once the hook confirmed it.
    pub async fn wake(&self, client: &UpstreamClient) -> Result<(), ApiError> {
        let Some(url) = &self.sleep.wake_url else {
            return Err(super::NoNode::NoneUp.into_error(&self.id));
        };
        let could_not_wake = || {
            ApiError::UpstreamUnavailable(format!(
                "No node of model '{}' is up and it could not be woken. Retry shortly.",
                self.id
            ))
        };
        let calls_before = self.sleep.wake_calls.load(Ordering::Acquire);
        let _hook = self.sleep.hook.lock().await;
        if self.sleep.is_booting() {
            return Ok(());
        }
        if self.sleep.wake_calls.load(Ordering::Acquire) != calls_before
            && self.sleep.last_wake_failed.load(Ordering::Acquire)
        {
            // The call this request waited behind failed a moment ago.
            return Err(could_not_wake());
        }
        let called = client.call_hook(url, HOOK_TIMEOUT).await;
        self.sleep
            .last_wake_failed
            .store(called.is_err(), Ordering::Release);
        self.sleep.wake_calls.fetch_add(1, Ordering::AcqRel);
        if let Err(err) = called {
            tracing::warn!(model = %self.id, error = %err, "the wake hook failed");
            return Err(could_not_wake());
        }
        tracing::info!(model = %self.id, "wake hook confirmed a boot");
        self.sleep.asleep.store(false, Ordering::Release);
        // A node that came up meanwhile needs no boot to wait for.
        if !self.is_up() {
            *self.sleep.booting() = Some(Instant::now());
        }
        for upstream in &self.upstreams {
            upstream.health.probe_soon();
        }
        Ok(())
    }

    /// The boot is over (a node came up): a later outage calls the hook again. The
    /// requests that waited for the boot are about to run: that counts as activity, so
    /// the keep-warm policy does not put the model back to sleep before they start.
    pub fn boot_done(&self) {
        if self.sleep.booting().take().is_some() {
            self.sleep.activity().last_request = Instant::now();
        }
    }

    /// Puts the model to sleep if it has a sleep hook and the keep-warm policy allows.
    pub async fn sleep_if_idle(&self, client: &UpstreamClient) {
        let Some(url) = &self.sleep.sleep_url else {
            return;
        };
        if self.sleep.is_asleep()
            || self.in_flight() > 0
            || self.queued() > 0
            || !self.sleep.idle(Instant::now())
        {
            return;
        }
        // Holding the hook lock: no wake interleaves with the sleep.
        let _hook = self.sleep.hook.lock().await;
        if self.sleep.is_booting() {
            // A boot is under way: requests wait for it without being in flight yet.
            return;
        }
        // Asleep before the hook is called, so requests arriving meanwhile wait for a
        // wake instead of going to a node that is shutting down; then look again.
        self.sleep.asleep.store(true, Ordering::Release);
        if self.in_flight() > 0 || self.queued() > 0 || !self.sleep.idle(Instant::now()) {
            self.sleep.asleep.store(false, Ordering::Release);
            return;
        }
        match client.call_hook(url, HOOK_TIMEOUT).await {
            Ok(()) => {
                tracing::info!(model = %self.id, "idle model put to sleep");
                *self.sleep.booting() = None;
                for upstream in &self.upstreams {
                    upstream.health.set_down();
                }
            }
            Err(err) => {
                self.sleep.asleep.store(false, Ordering::Release);
                tracing::warn!(model = %self.id, error = %err, "the sleep hook failed");
            }
        }
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
