-- What one key keeps in the store, accounted so that the bounds (`[workbench]
-- max_bytes_per_key`, `[jobs] max_pending_bytes_per_key`) are checked with one indexed
-- read. Same tables, columns and meanings as the PostgreSQL schema.

-- The Workbench's and Loom's bytes per key: titles, item contents, node texts and metas
-- (bytes of their UTF-8 text), plus 100 bytes a row (an item, a tree, a node: about what
-- a row and its index entries take), so that a million empty rows count too. Kept by the triggers below, in the transaction of every
-- write, so no code path can forget it: the sweeper's deletes of expired checkpoints
-- and a tree's cascade to its nodes included.
CREATE TABLE workbench_usage (
    key_id INTEGER PRIMARY KEY REFERENCES api_keys (id),
    bytes  INTEGER NOT NULL
) STRICT;

INSERT INTO workbench_usage (key_id, bytes)
SELECT key_id, SUM(bytes) FROM (
    SELECT key_id, 100 + length(CAST(title AS BLOB)) + length(CAST(content AS BLOB)) AS bytes
    FROM workbench_items
    UNION ALL
    SELECT key_id, 100 + length(CAST(title AS BLOB)) FROM loom_trees
    UNION ALL
    SELECT t.key_id, 100 + length(CAST(n.text AS BLOB)) + length(CAST(n.meta AS BLOB))
    FROM loom_nodes n JOIN loom_trees t ON t.id = n.tree_id
) GROUP BY key_id;

CREATE TRIGGER workbench_items_bytes_insert AFTER INSERT ON workbench_items BEGIN
    INSERT OR IGNORE INTO workbench_usage (key_id, bytes) VALUES (NEW.key_id, 0);
    UPDATE workbench_usage
    SET bytes = bytes + 100 + length(CAST(NEW.title AS BLOB)) + length(CAST(NEW.content AS BLOB))
    WHERE key_id = NEW.key_id;
END;

CREATE TRIGGER workbench_items_bytes_update AFTER UPDATE OF title, content ON workbench_items
BEGIN
    UPDATE workbench_usage
    SET bytes = bytes
        + length(CAST(NEW.title AS BLOB)) + length(CAST(NEW.content AS BLOB))
        - length(CAST(OLD.title AS BLOB)) - length(CAST(OLD.content AS BLOB))
    WHERE key_id = NEW.key_id;
END;

CREATE TRIGGER workbench_items_bytes_delete AFTER DELETE ON workbench_items BEGIN
    UPDATE workbench_usage
    SET bytes = bytes - 100 - length(CAST(OLD.title AS BLOB)) - length(CAST(OLD.content AS BLOB))
    WHERE key_id = OLD.key_id;
END;

CREATE TRIGGER loom_trees_bytes_insert AFTER INSERT ON loom_trees BEGIN
    INSERT OR IGNORE INTO workbench_usage (key_id, bytes) VALUES (NEW.key_id, 0);
    UPDATE workbench_usage SET bytes = bytes + 100 + length(CAST(NEW.title AS BLOB))
    WHERE key_id = NEW.key_id;
END;

CREATE TRIGGER loom_trees_bytes_update AFTER UPDATE OF title ON loom_trees BEGIN
    UPDATE workbench_usage
    SET bytes = bytes + length(CAST(NEW.title AS BLOB)) - length(CAST(OLD.title AS BLOB))
    WHERE key_id = NEW.key_id;
END;

-- Before the delete, while the tree's nodes are still there: a node is only ever deleted
-- with its tree (the cascade), so its bytes are taken off here.
CREATE TRIGGER loom_trees_bytes_delete BEFORE DELETE ON loom_trees BEGIN
    UPDATE workbench_usage
    SET bytes = bytes - 100 - length(CAST(OLD.title AS BLOB)) - COALESCE((
        SELECT SUM(100 + length(CAST(text AS BLOB)) + length(CAST(meta AS BLOB)))
        FROM loom_nodes WHERE tree_id = OLD.id
    ), 0)
    WHERE key_id = OLD.key_id;
END;

-- A node's text and meta never change once written.
CREATE TRIGGER loom_nodes_bytes_insert AFTER INSERT ON loom_nodes BEGIN
    UPDATE workbench_usage
    SET bytes = bytes + 100 + length(CAST(NEW.text AS BLOB)) + length(CAST(NEW.meta AS BLOB))
    WHERE key_id = (SELECT key_id FROM loom_trees WHERE id = NEW.tree_id);
END;

-- The request bytes of each job, so that a key's pending (queued and running) bytes are
-- one sum over a partial index of its pending jobs alone.
ALTER TABLE jobs ADD COLUMN request_bytes INTEGER NOT NULL DEFAULT 0;
UPDATE jobs SET request_bytes = length(request) WHERE request IS NOT NULL;
CREATE INDEX jobs_pending_by_key ON jobs (key_id, request_bytes)
    WHERE status IN ('queued', 'running');
