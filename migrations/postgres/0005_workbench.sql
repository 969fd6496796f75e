-- The Workbench's and Loom's saved work, per API key. Same tables, columns and meanings
-- as the SQLite schema. Nothing here is ever read by another key: every query names the
-- owning key_id. (0004 is taken by completion jobs.)

-- Saved prompts and runs (kind 'prompt' or 'run'; content is the page's JSON: prompt,
-- settings, completion). A row with expires_at set is a recovery checkpoint of a result
-- not yet saved: invisible from expires_at on and deleted by the sweeper; saving it sets
-- expires_at to NULL, and then it stays until deleted. version grows by one with every
-- change; a change that names an older version is refused (optimistic concurrency).
CREATE TABLE workbench_items (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_id     BIGINT NOT NULL REFERENCES api_keys (id),
    kind       TEXT   NOT NULL CHECK (kind IN ('prompt', 'run')),
    title      TEXT   NOT NULL,
    content    TEXT   NOT NULL,                  -- JSON
    version    BIGINT NOT NULL,
    created_at BIGINT NOT NULL,                  -- Unix seconds
    updated_at BIGINT NOT NULL,
    expires_at BIGINT                            -- Unix seconds; NULL once saved
);
CREATE INDEX workbench_items_key ON workbench_items (key_id, updated_at);
CREATE INDEX workbench_items_expiry ON workbench_items (expires_at) WHERE expires_at IS NOT NULL;

-- Loom: one tree per document. version counts changes to the tree's own fields (title).
CREATE TABLE loom_trees (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_id     BIGINT NOT NULL REFERENCES api_keys (id),
    title      TEXT   NOT NULL,
    version    BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE INDEX loom_trees_key ON loom_trees (key_id, updated_at);

-- A tree's nodes. Text is never changed after insert (an edit is a new sibling), so two
-- tabs adding nodes never conflict; the flags carry a version of their own. meta is the
-- page's JSON (the run's settings, per-token logprobs).
CREATE TABLE loom_nodes (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tree_id    BIGINT  NOT NULL REFERENCES loom_trees (id) ON DELETE CASCADE,
    parent_id  BIGINT  REFERENCES loom_nodes (id) ON DELETE CASCADE,
    text       TEXT    NOT NULL,
    meta       TEXT    NOT NULL,                 -- JSON
    bookmarked BOOLEAN NOT NULL DEFAULT FALSE,
    pruned     BOOLEAN NOT NULL DEFAULT FALSE,
    version    BIGINT  NOT NULL,
    created_at BIGINT  NOT NULL
);
CREATE INDEX loom_nodes_tree ON loom_nodes (tree_id, id);
