//! Live fleet changes: the config file the server was started with is read again, on
//! SIGHUP ([`on_hangup`]) or `POST /admin/reload` (`admin.rs`).
//!
//! The file is loaded and validated exactly as at start-up (`FLEETGATE_*` overrides
//! included). A file that is refused changes nothing: the error is logged (SIGHUP) or
//! answered (422 `invalid_config`) and the server runs on as it was. Otherwise every
//! model's nodes become the file's (`fleet/change.rs`): nodes are added, removed or
//! reweighted while requests keep the node they took. A new node is first asked what it
//! serves, as at start-up. The prober and the keep-warm loop read each model's nodes at
//! every beat, so they follow by themselves; the per-node metrics are started or dropped
//! here.
//!
//! With `[tls]`, the certificate and key files are read again too, before the config
//! file and whether or not it is refused (`https_certificate.rs`): new connections get
//! the new certificate, open ones keep theirs.
//!
//! Every other setting is read once at start-up: one that changed is named in the
//! answer and the log line (`restart.rs`) and takes effect only after a restart.

mod restart;

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use utoipa::ToSchema;

use crate::background::prober::Prober;
use crate::config::{Config, ConfigError};
use crate::fleet::{ModelChanges, Node};
use crate::state::AppState;

/// What a reload changed, and what it left for a restart.
#[derive(Debug, Serialize, ToSchema)]
pub struct Reloaded {
    /// The models whose nodes changed, with what changed (empty: the file's nodes are
    /// the running ones).
    pub models: Vec<ModelChanges>,
    /// Settings whose new value takes effect only after a restart (they are not
    /// applied): a top-level key or table such as `listen`, `database_url`,
    /// `redis_url` or `fleet`; `models.<key> of '<id>'`; or a model added or removed.
    pub restart_required: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("This server was not started from a config file, so there is nothing to reload.")]
    NoFile,
    #[error("Reloading {} failed, so nothing was changed: {source}", path.display())]
    Invalid {
        path: PathBuf,
        #[source]
        source: ConfigError,
    },
}

/// Reads the certificate files (with `[tls]`) and the config file again, and applies the
/// file's nodes (one reload at a time).
pub async fn reload(state: &AppState) -> Result<Reloaded, ReloadError> {
    let _one_at_a_time = state.reloading().lock().await;
    // First, and whatever the config file holds: a certificate renewed on disk is
    // served from now on (or the error is logged and the one served stays).
    if let Some(certificate) = state.certificate() {
        certificate.reload_logged();
    }
    let path = state
        .config()
        .source
        .as_deref()
        .ok_or(ReloadError::NoFile)?;
    let next = Config::load(path).map_err(|source| ReloadError::Invalid {
        path: path.to_owned(),
        source,
    })?;
    let planned = state.fleet().plan(&next);
    let added: Vec<Arc<Node>> = planned
        .iter()
        .flat_map(|p| p.added().iter().cloned())
        .collect();
    Prober::of(state).introduce(&added).await;
    let metrics = state.metrics();
    let models: Vec<ModelChanges> = planned
        .into_iter()
        .map(|planned| {
            let changes = planned.commit();
            // Removed first: a node replaced by one with its GPU label keeps its series.
            for node in &changes.removed {
                metrics.node_removed(&changes.model, &node.gpu);
            }
            for node in &changes.added {
                metrics.node_added(&changes.model, &node.gpu);
            }
            changes
        })
        .filter(|changes| !changes.is_empty())
        .collect();
    let restart_required = restart::needing_restart(state.config(), &next);
    tracing::info!(
        nodes = %describe(&models),
        restart_required = %restart_required.join(", "),
        "configuration reloaded"
    );
    Ok(Reloaded {
        models,
        restart_required,
    })
}

/// The changes for the log line, e.g. `llama-8b: added gpu-b (http://10.0.0.2:8000),
/// removed gpu-a (…), gpu-c weight 1 → 3`; `unchanged` when there are none.
fn describe(models: &[ModelChanges]) -> String {
    if models.is_empty() {
        return "unchanged".to_owned();
    }
    let model = |m: &ModelChanges| {
        let added = m
            .added
            .iter()
            .map(|n| format!("added {} ({})", n.gpu, n.url));
        let removed = m
            .removed
            .iter()
            .map(|n| format!("removed {} ({})", n.gpu, n.url));
        let changed = m.changed.iter().map(|n| {
            let limit = |l: Option<u32>| l.map_or("none".to_owned(), |l| l.to_string());
            format!(
                "{} weight {} → {}, max_in_flight {} → {}",
                n.gpu,
                n.weight_before,
                n.weight,
                limit(n.max_in_flight_before),
                limit(n.max_in_flight)
            )
        });
        let all: Vec<String> = added.chain(removed).chain(changed).collect();
        format!("{}: {}", m.model, all.join(", "))
    };
    models.iter().map(model).collect::<Vec<_>>().join("; ")
}

/// Listens for SIGHUP now, so that one sent once the server is up never meets the
/// default action (which ends the process); the future reloads on each, until it is
/// aborted. A refused file is logged at error level and the server runs on as it was.
/// `None` without a config file to read (or off Unix).
pub fn on_hangup(state: AppState) -> Option<impl Future<Output = ()> + Send + 'static> {
    state.config().source.as_ref()?;
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(hangups) => hangups,
            Err(err) => {
                tracing::warn!(error = %err, "cannot listen for SIGHUP; reload with POST /admin/reload");
                return None;
            }
        };
        Some(async move {
            while hangups.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading the configuration");
                if let Err(err) = reload(&state).await {
                    tracing::error!(error = %err, "reload refused; the running configuration stays");
                }
            }
        })
    }
    #[cfg(not(unix))]
    None::<std::future::Pending<()>>
}
