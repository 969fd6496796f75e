//! What can go wrong in the store, whichever part of it (`records`, `workbench`).

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
    #[error("database migration failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The URL's scheme (never the whole URL, which may hold a password).
    #[error(
        "unsupported database URL scheme {0:?}: use sqlite://PATH, sqlite::memory:, postgres://… or postgresql://…"
    )]
    UnsupportedUrl(String),
    #[error("invalid database URL: {0}")]
    InvalidUrl(String),
    /// Opening the store at start-up failed; `url` has no password.
    #[error("cannot open the store at {url}")]
    Open {
        url: String,
        #[source]
        source: Box<StoreError>,
    },
    /// The store could not be reached when it was needed (its own error was logged
    /// where it happened).
    #[error("the store cannot be reached")]
    Unavailable,
    /// A key with this prefix already exists.
    #[error("a key with prefix {0} already exists")]
    Duplicate(String),
    /// A value the schema cannot hold (a limit out of range, a malformed month…); the
    /// message names the field, never a secret.
    #[error("invalid value: {0}")]
    Invalid(String),
    #[error("cannot create the directory {}", .path.display())]
    CreateDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}
