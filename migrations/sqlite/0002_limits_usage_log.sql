-- Per-key limits, the usage ledger and the request metadata log. Same tables, columns and
-- meanings as the PostgreSQL schema.

-- Per-key limit overrides: NULL means the configured default (`limits` in the config)
-- applies. The upper bounds keep every value within PostgreSQL's INTEGER.
ALTER TABLE api_keys ADD COLUMN monthly_budget_tokens INTEGER
    CHECK (monthly_budget_tokens >= 0);
ALTER TABLE api_keys ADD COLUMN requests_per_minute INTEGER
    CHECK (requests_per_minute BETWEEN 1 AND 2147483647);
ALTER TABLE api_keys ADD COLUMN max_concurrent INTEGER
    CHECK (max_concurrent BETWEEN 1 AND 2147483647);
ALTER TABLE api_keys ADD COLUMN max_queued INTEGER
    CHECK (max_queued BETWEEN 0 AND 2147483647);

-- The usage ledger: the durable truth of monthly budgets. One row per finished request;
-- the UNIQUE request_id makes recording idempotent (a retry never counts twice).
CREATE TABLE usage_ledger (
    id                INTEGER PRIMARY KEY,
    key_id            INTEGER NOT NULL REFERENCES api_keys (id),
    request_id        TEXT    NOT NULL UNIQUE,
    month             TEXT    NOT NULL               -- 'YYYY-MM', UTC
        CHECK (month GLOB '[0-9][0-9][0-9][0-9]-[0-1][0-9]'
               AND substr(month, 6, 2) BETWEEN '01' AND '12'),
    prompt_tokens     INTEGER NOT NULL CHECK (prompt_tokens >= 0),
    completion_tokens INTEGER NOT NULL CHECK (completion_tokens >= 0),
    created_at        INTEGER NOT NULL               -- Unix seconds
) STRICT;
-- Serves a key's monthly sum from the index alone.
CREATE INDEX usage_ledger_key_month
    ON usage_ledger (key_id, month, prompt_tokens, completion_tokens);

-- Request metadata, never prompt or completion text. key_id has no REFERENCES on purpose:
-- a log row must never be refused. request_id is UNIQUE so that a batch retried after an
-- unclear commit is not written twice.
CREATE TABLE request_log (
    id                INTEGER PRIMARY KEY,
    request_id        TEXT    NOT NULL UNIQUE,
    created_at_ms     INTEGER NOT NULL,              -- Unix milliseconds
    key_id            INTEGER,
    key_prefix        TEXT,
    email             TEXT,
    client_ip         TEXT,
    endpoint          TEXT    NOT NULL,
    model             TEXT,
    prompt_tokens     INTEGER CHECK (prompt_tokens >= 0),
    completion_tokens INTEGER CHECK (completion_tokens >= 0),
    status            INTEGER NOT NULL CHECK (status BETWEEN 0 AND 65535),
    error_code        TEXT,
    latency_ms        INTEGER NOT NULL CHECK (latency_ms >= 0),
    workload          TEXT
) STRICT;
CREATE INDEX request_log_created ON request_log (created_at_ms);
CREATE INDEX request_log_key_created ON request_log (key_id, created_at_ms);
