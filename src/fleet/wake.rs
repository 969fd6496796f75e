//! Scale to zero: waking a model whose nodes are all down, and putting an idle model
//! back to sleep.
//!
//! A model may declare a wake hook (`wake_url`): when a request finds no node of the
//! model up, fleetgate `POST`s to it once (concurrent requests share the boot) and a 2xx
//! answer confirms that a boot has started. The requests then wait up to
//! `boot_timeout_ms` for the prober to see a node come up (see `completion/cold.rs` for
//! what the client sees meanwhile).
//!
//! With a sleep hook (`sleep_url`), the keep-warm policy (`sleep.rs`) puts an idle
//! model to sleep.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::model::{Model, NoNode};
use crate::error::ApiError;
use crate::upstream::UpstreamClient;

/// A hook that does not answer within this is taken as failed.
const HOOK_TIMEOUT: Duration = Duration::from_secs(30);

impl Model {
    /// Starts a boot (or joins the one under way). `Ok` once the hook confirmed it.
    pub async fn wake(&self, client: &UpstreamClient) -> Result<(), ApiError> {
        let Some(url) = &self.sleep.wake_url else {
            return Err(NoNode::NoneUp.into_error(&self.id));
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
        for node in self.nodes().iter() {
            node.health.probe_soon();
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
                for node in self.nodes().iter() {
                    node.health.set_down();
                }
            }
            Err(err) => {
                self.sleep.asleep.store(false, Ordering::Release);
                tracing::warn!(model = %self.id, error = %err, "the sleep hook failed");
            }
        }
    }
}
