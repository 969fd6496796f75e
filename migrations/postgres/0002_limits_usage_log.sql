-- Per-key limits, the usage ledger and the request metadata log. Same tables, columns and
-- meanings as the SQLite schema.

-- Per-key limit overrides: NULL means the configured default (`limits` in the config)
-- applies.
ALTER TABLE api_keys
    ADD COLUMN monthly_budget_tokens BIGINT  CHECK (monthly_budget_tokens >= 0),
    ADD COLUMN requests_per_minute   INTEGER CHECK (requests_per_minute >= 1),
    ADD COLUMN max_concurrent        INTEGER CHECK (max_concurrent >= 1),
    ADD COLUMN max_queued            INTEGER CHECK (max_queued >= 0);

-- The usage ledger: the durable truth of monthly budgets. One row per finished request;
-- the UNIQUE request_id makes recording idempotent (a retry never counts twice).
CREATE TABLE usage_ledger (
    id                BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_id            BIGINT NOT NULL REFERENCES api_keys (id),
    request_id        TEXT   NOT NULL UNIQUE,
    month             TEXT   NOT NULL                -- 'YYYY-MM', UTC
        CHECK (month ~ '^[0-9]{4}-(0[1-9]|1[0-2])$'),
    prompt_tokens     BIGINT NOT NULL CHECK (prompt_tokens >= 0),
    completion_tokens BIGINT NOT NULL CHECK (completion_tokens >= 0),
    created_at        BIGINT NOT NULL                -- Unix seconds
);
-- Serves a key's monthly sum from the index alone (an index-only scan).
CREATE INDEX usage_ledger_key_month
    ON usage_ledger (key_id, month) INCLUDE (prompt_tokens, completion_tokens);

-- Request metadata, never prompt or completion text. key_id has no REFERENCES on purpose:
-- a log row must never be refused. request_id is UNIQUE so that a batch retried after an
-- unclear commit is not written twice.
CREATE TABLE request_log (
    id                BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id        TEXT    NOT NULL UNIQUE,
    created_at_ms     BIGINT  NOT NULL,              -- Unix milliseconds
    key_id            BIGINT,
    key_prefix        TEXT,
    email             TEXT,
    client_ip         TEXT,
    endpoint          TEXT    NOT NULL,
    model             TEXT,
    prompt_tokens     BIGINT  CHECK (prompt_tokens >= 0),
    completion_tokens BIGINT  CHECK (completion_tokens >= 0),
    status            INTEGER NOT NULL CHECK (status BETWEEN 0 AND 65535),
    error_code        TEXT,
    latency_ms        BIGINT  NOT NULL CHECK (latency_ms >= 0),
    workload          TEXT
);
CREATE INDEX request_log_created ON request_log (created_at_ms);
CREATE INDEX request_log_key_created ON request_log (key_id, created_at_ms);
