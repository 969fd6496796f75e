//! The operator's commands that start nothing: `config check` (every problem of a
//! config file at once, each where it was set) and `backup` (a copy of the SQLite store,
//! said back).

use std::fmt::Write as _;
use std::path::Path;

use fleetgate::config::{Config, ConfigError, Origin, Problem};
use fleetgate::store::{Backup, redacted};

/// `config check`: a one-line summary when `path` is valid; else each problem printed
/// on a line of its own (`FILE:LINE:COLUMN: problem`) and an error that counts them.
pub fn check(path: &Path) -> anyhow::Result<String> {
    match Config::load(path) {
        Ok(config) => Ok(summary(path, &config)),
        Err(ConfigError::Invalid(problems)) => {
            for problem in &problems {
                eprintln!("{}", located(path, problem));
            }
            let count = problems.len();
            let plural = if count == 1 { "" } else { "s" };
            anyhow::bail!("{count} problem{plural} in {}", path.display())
        }
        Err(err) => Err(anyhow::Error::new(err).context(format!("loading {}", path.display()))),
    }
}

/// A problem as compilers say theirs, so that editors and CI can jump to the line.
fn located(path: &Path, problem: &Problem) -> String {
    let file = path.display();
    let message = &problem.message;
    match &problem.origin {
        Origin::Line { line, column } => format!("{file}:{line}:{column}: {message}"),
        Origin::Env(name) => format!("{name} (environment): {message}"),
        Origin::Unplaced => format!("{file}: {message}"),
    }
}

/// What a valid config sets up: its models and nodes, listeners and stores (URLs
/// without their passwords).
fn summary(path: &Path, config: &Config) -> String {
    let models: Vec<&str> = config.models.iter().map(|m| m.id.as_str()).collect();
    let nodes: usize = config.models.iter().map(|m| m.upstreams.len()).sum();
    let mut listeners = format!("{} (API)", config.listen);
    for (address, role) in [(config.ops_listen, "ops"), (config.admin_listen, "admin")] {
        if let Some(address) = address {
            let _ = write!(listeners, ", {address} ({role})");
        }
    }
    let counters = config
        .redis_url
        .as_deref()
        .map_or_else(|| "in process".to_owned(), redacted);
    format!(
        "{}: ok: {} model{} ({}) on {nodes} node{}; listening on {listeners}; store {}; counters {counters}",
        path.display(),
        models.len(),
        if models.len() == 1 { "" } else { "s" },
        models.join(", "),
        if nodes == 1 { "" } else { "s" },
        redacted(&config.database_url),
    )
}

/// What `backup` wrote: the file, its size and schema version, and each table's rows.
pub fn said(backup: &Backup) -> String {
    let version = backup
        .schema_version
        .map_or_else(|| "none".to_owned(), |v| v.to_string());
    let mut out = format!(
        "wrote {} ({} bytes, schema version {version}, integrity ok)",
        backup.path.display(),
        backup.bytes
    );
    let width = backup
        .tables
        .iter()
        .map(|(name, _)| name.len())
        .max()
        .unwrap_or(0);
    for (name, rows) in &backup.tables {
        let _ = write!(out, "\n  {name:<width$}  {rows:>10} rows");
    }
    out
}
