-- How long each request waited for its turn: in its key's queue for a running slot,
-- then in its model's fleet queue for a node with room (milliseconds; NULL for a
-- request that never got that far). Same column and meaning as the SQLite schema.
ALTER TABLE request_log ADD COLUMN queue_wait_ms BIGINT CHECK (queue_wait_ms >= 0);
