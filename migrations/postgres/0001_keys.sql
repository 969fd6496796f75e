-- API keys. The secret is never stored: only its visible prefix (for lookup and for
-- support) and its SHA-256 hash. Times are Unix seconds (UTC), as in the SQLite schema.
CREATE TABLE api_keys (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name       TEXT   NOT NULL,
    email      TEXT,
    prefix     TEXT   NOT NULL UNIQUE,            -- the UNIQUE index serves the per-request lookup
    key_hash   BYTEA  NOT NULL CHECK (octet_length(key_hash) = 32),
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);
