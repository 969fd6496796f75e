-- A key's share: its weight in its models' fleet queues (while a model's nodes are all
-- busy, keys with work waiting get node slots in proportion to their share, counted in
-- tokens). NULL means the configured default (`limits.share`) applies. Same column and
-- meaning as the PostgreSQL schema; the bounds are `key_limits::Limit::Share`'s.
ALTER TABLE api_keys ADD COLUMN share INTEGER
    CHECK (share BETWEEN 1 AND 1000);

-- A change of share alone is a key change too: the feed's update trigger (migration
-- 0003) watches the new column as well, so other servers see it within a poll period.
DROP TRIGGER api_keys_feed_update;
CREATE TRIGGER api_keys_feed_update
AFTER UPDATE OF name, email, prefix, key_hash, revoked_at, monthly_budget_tokens,
    requests_per_minute, max_concurrent, max_queued, share ON api_keys
BEGIN
    UPDATE key_feed SET seq = seq + 1 WHERE id = 1;
    UPDATE api_keys SET change_seq = (SELECT seq FROM key_feed WHERE id = 1) WHERE id = NEW.id;
END;
