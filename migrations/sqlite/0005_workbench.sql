-- The Workbench's and Loom's saved work, per API key. Same tables, columns and meanings
-- as the PostgreSQL schema. Nothing here is ever read by another key: every query names
-- the owning key_id. (0004 is taken by completion jobs.)

-- Saved prompts and runs (kind 'prompt' or 'run'; content is the page's JSON: prompt,
-- settings, completion). A row with expires_at set is a recovery checkpoint of a result
-- not yet saved: invisible from expires_at on and deleted by the sweeper; saving it sets
-- expires_at to NULL, and then it stays until deleted. version grows by one with every
-- change; a change that names an older version is refused (optimistic concurrency).
CREATE TABLE workbench_items (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    key_id     INTEGER NOT NULL REFERENCES api_keys (id),
    kind       TEXT    NOT NULL CHECK (kind IN ('prompt', 'run')),
    title      TEXT    NOT NULL,
    content    TEXT    NOT NULL,                 -- JSON
    version    INTEGER NOT NULL,
    created_at INTEGER NOT NULL,                 -- Unix seconds
    updated_at INTEGER NOT NULL,
    expires_at INTEGER                           -- Unix seconds; NULL once saved
) STRICT;
CREATE INDEX workbench_items_key ON workbench_items (key_id, updated_at);
CREATE INDEX workbench_items_expiry ON workbench_items (expires_at) WHERE expires_at IS NOT NULL;

-- Loom: one tree per document. version counts changes to the tree's own fields (title).
CREATE TABLE loom_trees (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    key_id     INTEGER NOT NULL REFERENCES api_keys (id),
    title      TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
) STRICT;
CREATE INDEX loom_trees_key ON loom_trees (key_id, updated_at);

-- A tree's nodes. Text is never changed after insert (an edit is a new sibling), so two
-- tabs adding nodes never conflict; the flags carry a version of their own. meta is the
-- page's JSON (the run's settings, per-token logprobs).
CREATE TABLE loom_nodes (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    tree_id    INTEGER NOT NULL REFERENCES loom_trees (id) ON DELETE CASCADE,
    parent_id  INTEGER REFERENCES loom_nodes (id) ON DELETE CASCADE,
    text       TEXT    NOT NULL,
    meta       TEXT    NOT NULL,                 -- JSON
    bookmarked INTEGER NOT NULL DEFAULT 0,
    pruned     INTEGER NOT NULL DEFAULT 0,
    version    INTEGER NOT NULL,
    created_at INTEGER NOT NULL
) STRICT;
CREATE INDEX loom_nodes_tree ON loom_nodes (tree_id, id);
