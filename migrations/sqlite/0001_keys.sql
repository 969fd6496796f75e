-- API keys. The secret is never stored: only its visible prefix (for lookup and for
-- support) and its SHA-256 hash. Times are Unix seconds (UTC).
CREATE TABLE api_keys (
    id         INTEGER PRIMARY KEY AUTOINCREMENT, -- never reused, so later tables can refer to it
    name       TEXT    NOT NULL,
    email      TEXT,
    prefix     TEXT    NOT NULL UNIQUE,           -- the UNIQUE index serves the per-request lookup
    key_hash   BLOB    NOT NULL CHECK (length(key_hash) = 32),
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
) STRICT;
