-- The key change feed: every running server keeps the keys in memory and reads only
-- what changed since it last looked (`WHERE change_seq > ?`), so a key created, revoked
-- or given new limits by another process (the CLI, another replica) is seen within a
-- poll period without a query per request.
--
-- `key_feed.seq` counts key changes; each changed row takes the next number. SQLite has
-- one writer at a time, so the numbers are taken in commit order: a reader that has seen
-- number N has seen every change before it.
CREATE TABLE key_feed (
    id  INTEGER PRIMARY KEY CHECK (id = 1),
    seq INTEGER NOT NULL
) STRICT;
INSERT INTO key_feed (id, seq) VALUES (1, 0);

ALTER TABLE api_keys ADD COLUMN change_seq INTEGER NOT NULL DEFAULT 0;
UPDATE key_feed SET seq = (SELECT COUNT(*) FROM api_keys);
UPDATE api_keys SET change_seq = (SELECT COUNT(*) FROM api_keys AS k WHERE k.id <= api_keys.id);
CREATE INDEX api_keys_change_seq ON api_keys (change_seq);

-- The triggers' own UPDATE of change_seq fires neither trigger again (it changes none of
-- the columns they watch).
CREATE TRIGGER api_keys_feed_insert AFTER INSERT ON api_keys
BEGIN
    UPDATE key_feed SET seq = seq + 1 WHERE id = 1;
    UPDATE api_keys SET change_seq = (SELECT seq FROM key_feed WHERE id = 1) WHERE id = NEW.id;
END;
CREATE TRIGGER api_keys_feed_update
AFTER UPDATE OF name, email, prefix, key_hash, revoked_at, monthly_budget_tokens,
    requests_per_minute, max_concurrent, max_queued ON api_keys
BEGIN
    UPDATE key_feed SET seq = seq + 1 WHERE id = 1;
    UPDATE api_keys SET change_seq = (SELECT seq FROM key_feed WHERE id = 1) WHERE id = NEW.id;
END;
