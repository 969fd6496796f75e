-- Completion jobs (`Prefer: respond-async`): submitted now, run by a worker of any
-- replica, harvested later. Times are Unix milliseconds.
--
-- `attempts` is the fencing number: a claim increments it, and a worker may renew,
-- requeue or finish a job only while it still holds the attempt it claimed, so a worker
-- whose lease lapsed (and whose job another worker took over) changes nothing.
--
-- Content (`request`, `result`) is deleted `content_ttl` after the job ends; the row
-- (dedup and accounting metadata) `metadata_ttl` after it ends.
CREATE TABLE jobs (
    id                TEXT    PRIMARY KEY,
    key_id            INTEGER NOT NULL,
    model             TEXT    NOT NULL,
    status            TEXT    NOT NULL,
    custom_id         TEXT,
    idempotency_key   TEXT,
    request_hash      BLOB    NOT NULL,
    request           BLOB,
    result            BLOB,
    result_status     INTEGER,
    error_code        TEXT,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    attempts          INTEGER NOT NULL DEFAULT 0,
    lease_owner       TEXT,
    lease_until_ms    INTEGER,
    run_after_ms      INTEGER NOT NULL,
    cancel_requested  INTEGER NOT NULL DEFAULT 0,
    created_at_ms     INTEGER NOT NULL,
    started_at_ms     INTEGER,
    finished_at_ms    INTEGER,
    expires_at_ms     INTEGER NOT NULL
);
CREATE UNIQUE INDEX jobs_idempotency ON jobs (key_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_runnable ON jobs (status, run_after_ms);
CREATE INDEX jobs_by_key ON jobs (key_id, id);
CREATE INDEX jobs_finished ON jobs (finished_at_ms) WHERE finished_at_ms IS NOT NULL;
