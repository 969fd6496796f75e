//! What the Workbench and Loom keep per API key — saved prompts and runs (and the
//! recovery checkpoints of runs not yet saved), Loom trees and their nodes — and the
//! [`WorkbenchStore`] trait both backends implement (`workbench_sql.rs`).
//!
//! Every method takes the owning key's id and touches nothing of another key: what
//! another key owns is as absent as what does not exist. Every method that depends on
//! the time takes `now` (Unix seconds), so that tests can move the clock.
//!
//! What a key keeps is counted in bytes (titles, contents, node texts and metas, and
//! [`ROW_BYTES`] a row; the store's triggers keep the sum per key, migration 0006). A write that adds bytes takes
//! the key's bound (`max_bytes`) and is refused whole with [`StoreError::QuotaExceeded`]
//! when it would leave the key over it. Lists come a [`Page`] at a time.

use super::records::StoreError;

/// One row of `workbench_items`: a saved prompt or run, or a recovery checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct ItemRecord {
    pub id: i64,
    /// `prompt` or `run`.
    pub kind: String,
    pub title: String,
    /// The page's JSON (prompt, settings, completion), stored as it came.
    pub content: String,
    pub version: i64,
    pub created_at: i64,
    pub updated_at: i64,
    /// `Some`: a recovery checkpoint, gone at this time (Unix seconds); `None`: saved.
    pub expires_at: Option<i64>,
}

/// An item as a list shows it: everything but its content.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct ItemSummary {
    pub id: i64,
    pub kind: String,
    pub title: String,
    pub version: i64,
    pub created_at: i64,
    pub updated_at: i64,
    pub expires_at: Option<i64>,
}

/// The place of an entry in a list ordered most recently changed first: a page after
/// it holds the entries changed before it (ties by id, higher first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    pub updated_at: i64,
    pub id: i64,
}

/// A page of a list: at most `limit` entries, those after `after` (from the start
/// when `None`).
#[derive(Clone, Copy, Debug)]
pub struct Page {
    pub after: Option<Cursor>,
    pub limit: u32,
}

impl Page {
    /// `(updated_at, id)` of the cursor, or values above any entry's for the first page.
    pub(super) fn bounds(&self) -> (i64, i64) {
        self.after
            .map_or((i64::MAX, i64::MAX), |after| (after.updated_at, after.id))
    }
}

/// A new item; `expires_at` as in [`ItemRecord`].
#[derive(Clone, Debug)]
pub struct NewItem<'a> {
    pub kind: &'a str,
    pub title: &'a str,
    pub content: &'a str,
    pub expires_at: Option<i64>,
}

/// A change to an item made from `version`; `None` fields stay as they are. `save`
/// turns a checkpoint into a saved item (a saved item stays saved).
#[derive(Clone, Debug)]
pub struct ItemChange<'a> {
    pub version: i64,
    pub title: Option<&'a str>,
    pub content: Option<&'a str>,
    pub save: bool,
}

/// One row of `loom_trees`.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct TreeRecord {
    pub id: i64,
    pub title: String,
    pub version: i64,
    pub created_at: i64,
    pub updated_at: i64,
}

/// One row of `loom_nodes`. Its text never changes once written.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct NodeRecord {
    pub id: i64,
    pub tree_id: i64,
    /// `None` for the root.
    pub parent_id: Option<i64>,
    pub text: String,
    /// The page's JSON (the run's settings, per-token logprobs).
    pub meta: String,
    pub bookmarked: bool,
    pub pruned: bool,
    pub version: i64,
    pub created_at: i64,
}

/// A node of a tree being created (a new tree's root, or an imported tree's nodes).
/// `parent` is the index of an earlier node in the same list; `None` only for the
/// first, the root.
#[derive(Clone, Debug)]
pub struct TreeNode<'a> {
    pub parent: Option<usize>,
    pub text: &'a str,
    pub meta: &'a str,
    pub bookmarked: bool,
    pub pruned: bool,
}

/// A node added to a tree: a child of `parent_id`.
#[derive(Clone, Copy, Debug)]
pub struct NewNode<'a> {
    pub parent_id: i64,
    pub text: &'a str,
    /// The page's JSON, as in [`NodeRecord`].
    pub meta: &'a str,
}

/// A change to a node's flags made from `version`; `None` leaves a flag as it is.
#[derive(Clone, Copy, Debug)]
pub struct NodeFlags {
    pub version: i64,
    pub bookmarked: Option<bool>,
    pub pruned: Option<bool>,
}

/// The outcome of a change that names the version it was made from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Versioned<T> {
    Changed(T),
    /// No such thing for this key.
    Missing,
    /// Changed meanwhile: it is at `current` now, and nothing was changed.
    Stale {
        current: i64,
    },
}

/// The outcome of [`WorkbenchStore::add_node`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Added {
    Node(NodeRecord),
    /// No such tree for this key.
    NoTree,
    /// The parent is not a node of this tree.
    NoParent,
}

#[async_trait::async_trait]
pub trait WorkbenchStore: Send + Sync {
    /// The bytes the key keeps in the Workbench and Loom.
    async fn stored_bytes(&self, key_id: i64) -> Result<i64, StoreError>;

    async fn create_item(
        &self,
        key_id: i64,
        item: &NewItem<'_>,
        max_bytes: i64,
        now: i64,
    ) -> Result<ItemRecord, StoreError>;

    /// A page of the key's saved items and live checkpoints, most recently changed
    /// first, without their content.
    async fn items(
        &self,
        key_id: i64,
        now: i64,
        page: &Page,
    ) -> Result<Vec<ItemSummary>, StoreError>;

    /// `None` when there is no such item for this key, or it was a checkpoint that has
    /// expired (whether or not the sweeper has deleted it yet).
    async fn item(&self, key_id: i64, id: i64, now: i64) -> Result<Option<ItemRecord>, StoreError>;

    async fn update_item(
        &self,
        key_id: i64,
        id: i64,
        change: &ItemChange<'_>,
        max_bytes: i64,
        now: i64,
    ) -> Result<Versioned<ItemRecord>, StoreError>;

    /// Whether there was such an item (an expired checkpoint counts as none).
    async fn delete_item(&self, key_id: i64, id: i64, now: i64) -> Result<bool, StoreError>;

    /// Deletes the checkpoints expired at `now`, of every key; returns how many.
    async fn sweep_checkpoints(&self, now: i64) -> Result<u64, StoreError>;

    /// A tree with its nodes. `nodes` must be non-empty, start with the root and name
    /// only earlier nodes as parents ([`StoreError::Invalid`] if not). Returns the tree
    /// and its nodes in the order given.
    ///
    /// Written [`TREE_BATCH_NODES`] nodes to a transaction, pausing between two as long
    /// as the last took, so that a large tree does not hold SQLite's one writer for
    /// long; the tree shows its nodes as they are written. When a batch fails or would
    /// leave the key over `max_bytes`, what was written is deleted again.
    async fn create_tree(
        &self,
        key_id: i64,
        title: &str,
        nodes: &[TreeNode<'_>],
        max_bytes: i64,
        now: i64,
    ) -> Result<(TreeRecord, Vec<NodeRecord>), StoreError>;

    /// A page of the key's trees, most recently changed first.
    async fn trees(&self, key_id: i64, page: &Page) -> Result<Vec<TreeRecord>, StoreError>;

    /// The tree and all its nodes (pruned ones too), oldest node first.
    async fn tree(
        &self,
        key_id: i64,
        id: i64,
    ) -> Result<Option<(TreeRecord, Vec<NodeRecord>)>, StoreError>;

    async fn rename_tree(
        &self,
        key_id: i64,
        id: i64,
        version: i64,
        title: &str,
        now: i64,
    ) -> Result<Versioned<TreeRecord>, StoreError>;

    /// Deletes the tree and its nodes; whether there was such a tree.
    async fn delete_tree(&self, key_id: i64, id: i64) -> Result<bool, StoreError>;

    /// Appends a child of `parent_id`. Nodes are only ever added, so concurrent adds
    /// from two tabs never conflict.
    async fn add_node(
        &self,
        key_id: i64,
        tree_id: i64,
        node: &NewNode<'_>,
        max_bytes: i64,
        now: i64,
    ) -> Result<Added, StoreError>;

    async fn set_node_flags(
        &self,
        key_id: i64,
        tree_id: i64,
        node_id: i64,
        flags: &NodeFlags,
        now: i64,
    ) -> Result<Versioned<NodeRecord>, StoreError>;
}

/// What a row (an item, a tree, a node) counts against its key's bytes besides its
/// text: about what the row and its index entries take, so that many empty rows count
/// too. Migration 0006's triggers count the same.
pub const ROW_BYTES: i64 = 100;

/// Nodes of a tree written in one transaction (see [`WorkbenchStore::create_tree`]).
pub const TREE_BATCH_NODES: usize = 500;

/// Checks that `nodes` form a tree as [`WorkbenchStore::create_tree`] requires.
pub(super) fn check_tree(nodes: &[TreeNode<'_>]) -> Result<(), StoreError> {
    let Some(root) = nodes.first() else {
        return Err(StoreError::Invalid("a tree needs a root node".to_owned()));
    };
    if root.parent.is_some() {
        return Err(StoreError::Invalid(
            "the first node is the root and has no parent".to_owned(),
        ));
    }
    for (index, node) in nodes.iter().enumerate().skip(1) {
        match node.parent {
            Some(parent) if parent < index => {}
            _ => {
                return Err(StoreError::Invalid(format!(
                    "node {index} must name an earlier node as its parent"
                )));
            }
        }
    }
    Ok(())
}
