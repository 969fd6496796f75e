//! Durable state behind one trait: SQLite (embedded default) and PostgreSQL.
