//! `fleetgate backup`: a consistent copy of a SQLite store, taken while the gateway
//! serves. `VACUUM INTO` reads the database in one read transaction, so the copy is the
//! database as of one moment; in WAL mode (`sqlite.rs`) a reader neither waits for the
//! writer nor holds it up, so the serving process goes on writing meanwhile. The copy is
//! written beside the destination and renamed into place, so a destination is never
//! half written. A PostgreSQL store is copied with PostgreSQL's own tools.

use std::path::{Path, PathBuf};
use std::str::FromStr as _;

use anyhow::{Context as _, bail};
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions as _, Connection as _};

use super::sqlite::is_memory;

/// What a backup wrote.
#[derive(Debug)]
pub struct Backup {
    pub path: PathBuf,
    pub bytes: u64,
    /// The newest migration the copy has (`_sqlx_migrations`).
    pub schema_version: Option<i64>,
    /// Each table of the copy with its rows, by name.
    pub tables: Vec<(String, i64)>,
}

/// Copies the store at `database_url` to `dest` (a new file, or any file with
/// `overwrite`), then reads the copy back to say what it holds.
pub async fn backup(database_url: &str, dest: &Path, overwrite: bool) -> anyhow::Result<Backup> {
    if !database_url.starts_with("sqlite:") {
        bail!(
            "fleetgate backup copies SQLite stores; copy a PostgreSQL database with its own tools: `pg_dump --format=custom --file=fleetgate.dump \"$DATABASE_URL\"` (restored with `pg_restore --dbname=\"$DATABASE_URL\" fleetgate.dump`)"
        );
    }
    if is_memory(database_url) {
        bail!("the store is in memory (database_url {database_url}): there is no file to back up");
    }
    let source = SqliteConnectOptions::from_str(database_url)
        .context("reading database_url")?
        // Never make a database here: a missing one is a wrong URL, not an empty store.
        .create_if_missing(false)
        .busy_timeout(std::time::Duration::from_secs(5));
    let source_path = source.get_filename().to_path_buf();
    if !source_path.is_file() {
        bail!(
            "no database at {} (database_url): nothing to back up",
            source_path.display()
        );
    }
    if dest.exists() && !overwrite {
        bail!("{} exists; pass --force to replace it", dest.display());
    }
    // The store itself (or its write-ahead log) as the destination would be replaced
    // under the gateway writing to it.
    if let (Ok(source), Ok(target)) = (source_path.canonicalize(), dest.canonicalize()) {
        let wal_or_shm = |suffix: &str| {
            let mut name = source.clone().into_os_string();
            name.push(suffix);
            name == target.as_os_str()
        };
        if source == target || wal_or_shm("-wal") || wal_or_shm("-shm") {
            bail!(
                "{} is the store itself: back it up to another file",
                dest.display()
            );
        }
    }
    let partial = partial_path(dest)?;
    // A copy left by an interrupted run: VACUUM INTO writes only to a new file.
    if partial.exists() {
        std::fs::remove_file(&partial)
            .with_context(|| format!("removing {}", partial.display()))?;
    }
    let mut connection = source
        .connect()
        .await
        .with_context(|| format!("opening {}", source_path.display()))?;
    let copied = sqlx::query("VACUUM INTO ?")
        .bind(partial.to_string_lossy().into_owned())
        .execute(&mut connection)
        .await;
    connection.close().await.ok();
    if let Err(err) = copied {
        std::fs::remove_file(&partial).ok();
        return Err(err).with_context(|| format!("copying into {}", partial.display()));
    }
    // Checked before it takes the destination's place: a copy that fails the check
    // never replaces an earlier backup.
    let backup = match read_back(&partial).await {
        Ok(backup) => backup,
        Err(err) => {
            std::fs::remove_file(&partial).ok();
            return Err(err);
        }
    };
    if let Err(err) = std::fs::rename(&partial, dest) {
        std::fs::remove_file(&partial).ok();
        return Err(err)
            .with_context(|| format!("moving {} to {}", partial.display(), dest.display()));
    }
    Ok(Backup {
        path: dest.to_owned(),
        ..backup
    })
}

/// `dest` with `.partial` added to its name, in its directory (which must exist).
fn partial_path(dest: &Path) -> anyhow::Result<PathBuf> {
    let Some(name) = dest.file_name() else {
        bail!("{} is not a file name", dest.display());
    };
    let dir = dest.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir
        && !dir.is_dir()
    {
        bail!("no directory {} to write the backup into", dir.display());
    }
    let mut partial = name.to_owned();
    partial.push(".partial");
    Ok(dest.with_file_name(partial))
}

/// Opens the copy read-only: checks it, and counts what it holds.
async fn read_back(path: &Path) -> anyhow::Result<Backup> {
    let mut copy = SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .connect()
        .await
        .with_context(|| format!("opening the copy {}", path.display()))?;
    let check: String = sqlx::query_scalar("PRAGMA quick_check")
        .fetch_one(&mut copy)
        .await?;
    if check != "ok" {
        bail!("the copy {} fails SQLite's check: {check}", path.display());
    }
    let schema_version: Option<i64> =
        sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(&mut copy)
            .await?;
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_schema WHERE type = 'table' \
         AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' AND name <> '_sqlx_migrations' ORDER BY name",
    )
    .fetch_all(&mut copy)
    .await?;
    let mut tables = Vec::with_capacity(names.len());
    for name in names {
        // A name from the copy's own schema, quoted as an identifier.
        let count = format!("SELECT COUNT(*) FROM \"{}\"", name.replace('"', "\"\""));
        let rows: i64 = sqlx::query_scalar(AssertSqlSafe(count))
            .fetch_one(&mut copy)
            .await?;
        tables.push((name, rows));
    }
    copy.close().await.ok();
    let bytes = std::fs::metadata(path)?.len();
    Ok(Backup {
        path: path.to_owned(),
        bytes,
        schema_version,
        tables,
    })
}
