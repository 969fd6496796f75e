//! How the embedded migrations (`migrations/` at the repository's root) are run: see
//! docs/upgrading.md.

/// `migrator`, set to open a database that a newer release has migrated further: a
/// rollback runs the previous binary on the expanded schema (migrations only ever add,
/// `.ci/check-migrations.py`), and sqlx would otherwise refuse a database with an applied
/// migration the binary does not have. An applied migration whose file differs is still
/// refused (its checksum), and none is ever run down.
pub(super) fn rollback_tolerant(mut migrator: sqlx::migrate::Migrator) -> sqlx::migrate::Migrator {
    migrator.set_ignore_missing(true);
    migrator
}
