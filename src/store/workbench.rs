//! What the Workbench and Loom keep per API key — saved prompts and runs (and the
//! recovery checkpoints of runs not yet saved), Loom trees and their nodes — and the
//! [`WorkbenchStore`] trait both backends implement (`workbench_sql.rs`).
//!
//! Every method takes the owning key's id and touches nothing of another key: what
//! another key owns is as absent as what does not exist. Every method that depends on
//! the time takes `now` (Unix seconds), so that tests can move the clock.

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
    async fn create_item(
        &self,
        key_id: i64,
        item: &NewItem<'_>,
        now: i64,
    ) -> Result<ItemRecord, StoreError>;

    /// The key's saved items and live checkpoints, most recently changed first.
    async fn items(&self, key_id: i64, now: i64) -> Result<Vec<ItemRecord>, StoreError>;

    /// `None` when there is no such item for this key, or it was a checkpoint that has
    /// expired (whether or not the sweeper has deleted it yet).
    async fn item(&self, key_id: i64, id: i64, now: i64) -> Result<Option<ItemRecord>, StoreError>;

    async fn update_item(
        &self,
        key_id: i64,
        id: i64,
        change: &ItemChange<'_>,
        now: i64,
    ) -> Result<Versioned<ItemRecord>, StoreError>;

    /// Whether there was such an item (an expired checkpoint counts as none).
    async fn delete_item(&self, key_id: i64, id: i64, now: i64) -> Result<bool, StoreError>;

    /// Deletes the checkpoints expired at `now`, of every key; returns how many.
    async fn sweep_checkpoints(&self, now: i64) -> Result<u64, StoreError>;

    /// A tree with its nodes, in one transaction. `nodes` must be non-empty, start with
    /// the root and name only earlier nodes as parents ([`StoreError::Invalid`] if not).
    /// Returns the tree and its nodes in the order given.
    async fn create_tree(
        &self,
        key_id: i64,
        title: &str,
        nodes: &[TreeNode<'_>],
        now: i64,
    ) -> Result<(TreeRecord, Vec<NodeRecord>), StoreError>;

    /// The key's trees, most recently changed first.
    async fn trees(&self, key_id: i64) -> Result<Vec<TreeRecord>, StoreError>;

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
        parent_id: i64,
        text: &str,
        meta: &str,
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
