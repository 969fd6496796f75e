-- What one key keeps in the store, accounted so that the bounds (`[workbench]
-- max_bytes_per_key`, `[jobs] max_pending_bytes_per_key`) are checked with one indexed
-- read. Same tables, columns and meanings as the SQLite schema.

-- The Workbench's and Loom's bytes per key: titles, item contents, node texts and metas
-- (bytes of their UTF-8 text), plus 100 bytes a row (an item, a tree, a node: about what
-- a row and its index entries take), so that a million empty rows count too. Kept by the triggers below, in the transaction of every
-- write, so no code path can forget it: the sweeper's deletes of expired checkpoints
-- and a tree's cascade to its nodes included. The row lock of a key's usage row also
-- orders that key's concurrent writes, so a bound checked after a write in the same
-- transaction holds across replicas.
CREATE TABLE workbench_usage (
    key_id BIGINT PRIMARY KEY REFERENCES api_keys (id),
    bytes  BIGINT NOT NULL
);

INSERT INTO workbench_usage (key_id, bytes)
SELECT key_id, SUM(bytes) FROM (
    SELECT key_id, 100 + octet_length(title)::BIGINT + octet_length(content) AS bytes
    FROM workbench_items
    UNION ALL
    SELECT key_id, 100 + octet_length(title) FROM loom_trees
    UNION ALL
    SELECT t.key_id, 100 + octet_length(n.text)::BIGINT + octet_length(n.meta)
    FROM loom_nodes n JOIN loom_trees t ON t.id = n.tree_id
) AS owned GROUP BY key_id;

CREATE FUNCTION workbench_usage_add(owner BIGINT, delta BIGINT) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO workbench_usage (key_id, bytes) VALUES (owner, delta)
    ON CONFLICT (key_id) DO UPDATE SET bytes = workbench_usage.bytes + EXCLUDED.bytes
$$;

CREATE FUNCTION workbench_items_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM workbench_usage_add(OLD.key_id,
            -(100 + octet_length(OLD.title)::BIGINT + octet_length(OLD.content)));
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        PERFORM workbench_usage_add(NEW.key_id,
            100 + octet_length(NEW.title)::BIGINT + octet_length(NEW.content));
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER workbench_items_bytes
AFTER INSERT OR UPDATE OF title, content OR DELETE ON workbench_items
FOR EACH ROW EXECUTE FUNCTION workbench_items_bytes();

-- Before a tree's delete, while its nodes are still there: a node is only ever deleted
-- with its tree (the cascade), so its bytes are taken off here.
CREATE FUNCTION loom_trees_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM workbench_usage_add(OLD.key_id, -(100 + octet_length(OLD.title) + COALESCE((
            SELECT SUM(100 + octet_length(text)::BIGINT + octet_length(meta))
            FROM loom_nodes WHERE tree_id = OLD.id
        ), 0))::BIGINT);
        RETURN OLD;
    ELSIF TG_OP = 'UPDATE' THEN
        PERFORM workbench_usage_add(NEW.key_id,
            octet_length(NEW.title)::BIGINT - octet_length(OLD.title));
    ELSE
        PERFORM workbench_usage_add(NEW.key_id, 100 + octet_length(NEW.title));
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER loom_trees_bytes
BEFORE INSERT OR UPDATE OF title OR DELETE ON loom_trees
FOR EACH ROW EXECUTE FUNCTION loom_trees_bytes();

-- A node's text and meta never change once written.
CREATE FUNCTION loom_nodes_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM workbench_usage_add(
        (SELECT key_id FROM loom_trees WHERE id = NEW.tree_id),
        100 + octet_length(NEW.text)::BIGINT + octet_length(NEW.meta));
    RETURN NULL;
END
$$;
CREATE TRIGGER loom_nodes_bytes AFTER INSERT ON loom_nodes
FOR EACH ROW EXECUTE FUNCTION loom_nodes_bytes();

-- The request bytes of each job, so that a key's pending (queued and running) bytes are
-- one sum over a partial index of its pending jobs alone.
ALTER TABLE jobs ADD COLUMN request_bytes BIGINT NOT NULL DEFAULT 0;
UPDATE jobs SET request_bytes = octet_length(request) WHERE request IS NOT NULL;
CREATE INDEX jobs_pending_by_key ON jobs (key_id, request_bytes)
    WHERE status IN ('queued', 'running');
