-- The key change feed: every running server keeps the keys in memory and reads only
-- what changed since it last looked (`WHERE change_seq > $1`), so a key created, revoked
-- or given new limits by another process (the CLI, another replica) is seen within a
-- poll period without a query per request; a NOTIFY on `fleetgate_keys` tells listening
-- servers at once.
--
-- `key_feed.seq` counts key changes; each changed row takes the next number under the
-- feed row's lock, held until its transaction ends. So numbers are taken in commit
-- order (unlike a SEQUENCE's): a reader that has seen number N has seen every change
-- before it.
CREATE TABLE key_feed (
    id  INTEGER PRIMARY KEY CHECK (id = 1),
    seq BIGINT  NOT NULL
);
INSERT INTO key_feed (id, seq) VALUES (1, 0);

ALTER TABLE api_keys ADD COLUMN change_seq BIGINT NOT NULL DEFAULT 0;
UPDATE api_keys AS k SET change_seq = n.rank
    FROM (SELECT id, ROW_NUMBER() OVER (ORDER BY id) AS rank FROM api_keys) AS n
    WHERE k.id = n.id;
UPDATE key_feed SET seq = (SELECT COUNT(*) FROM api_keys);
CREATE INDEX api_keys_change_seq ON api_keys (change_seq);

CREATE FUNCTION api_keys_feed() RETURNS trigger AS $$
BEGIN
    UPDATE key_feed SET seq = seq + 1 WHERE id = 1 RETURNING seq INTO NEW.change_seq;
    PERFORM pg_notify('fleetgate_keys', NEW.change_seq::TEXT);
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER api_keys_feed BEFORE INSERT OR UPDATE OF name, email, prefix, key_hash,
    revoked_at, monthly_budget_tokens, requests_per_minute, max_concurrent, max_queued
    ON api_keys FOR EACH ROW EXECUTE FUNCTION api_keys_feed();
