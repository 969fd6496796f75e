//! [`WorkbenchStore`](super::workbench::WorkbenchStore) for both backends, with the same
//! SQL and binds, written once (as `shared.rs` does for the `Store`, and for the same
//! reason: the pool types differ, the queries do not).
//!
//! Ownership is in the SQL: every statement names the key, items and trees directly,
//! nodes through their tree. The bytes a key keeps are summed by the schema's triggers
//! (`workbench_usage`); a write that adds bytes reads the sum in its own transaction
//! after writing and rolls back when it is over the bound, so a refused write leaves
//! nothing. Booleans are bound as `bool` and read back as `bool`:
//! `BOOLEAN` in PostgreSQL, `INTEGER` 0/1 in SQLite.

/// The columns of `workbench_items`, in [`ItemRecord`](super::workbench::ItemRecord) order.
macro_rules! item_columns {
    () => {
        "id, kind, title, content, version, created_at, updated_at, expires_at"
    };
}

/// The columns of `workbench_items` but the content, in
/// [`ItemSummary`](super::workbench::ItemSummary) order.
macro_rules! item_summary_columns {
    () => {
        "id, kind, title, version, created_at, updated_at, expires_at"
    };
}

/// The columns of `loom_trees`.
macro_rules! tree_columns {
    () => {
        "id, title, version, created_at, updated_at"
    };
}

/// The columns of `loom_nodes`.
macro_rules! node_columns {
    () => {
        "id, tree_id, parent_id, text, meta, bookmarked, pruned, version, created_at"
    };
}

/// `impl WorkbenchStore for $store` on `self.pool` (`$db` its sqlx database).
macro_rules! impl_workbench_store {
    ($store:ty, $db:ty) => {
        /// Marks the tree changed at `now`, in `tx`; whether the key owns such a tree
        /// (the check and the touch in one statement, before a node changes).
        async fn touch_tree(
            tx: &mut sqlx::Transaction<'_, $db>,
            key_id: i64,
            tree_id: i64,
            now: i64,
        ) -> Result<bool, StoreError> {
            let owned =
                sqlx::query("UPDATE loom_trees SET updated_at = $1 WHERE id = $2 AND key_id = $3")
                    .bind(now)
                    .bind(tree_id)
                    .bind(key_id)
                    .execute(&mut **tx)
                    .await?;
            Ok(owned.rows_affected() > 0)
        }

        /// Whether the key's bytes, as `tx` has changed them, are within `max_bytes`
        /// ([`StoreError::QuotaExceeded`] if not: the caller then drops `tx`).
        async fn within_bound(
            tx: &mut sqlx::Transaction<'_, $db>,
            key_id: i64,
            max_bytes: i64,
        ) -> Result<(), StoreError> {
            let bytes: Option<i64> =
                sqlx::query_scalar("SELECT bytes FROM workbench_usage WHERE key_id = $1")
                    .bind(key_id)
                    .fetch_optional(&mut **tx)
                    .await?;
            let bytes = bytes.unwrap_or(0);
            if bytes > max_bytes {
                return Err(StoreError::QuotaExceeded {
                    bytes,
                    limit: max_bytes,
                });
            }
            Ok(())
        }

        /// Writes `nodes` of a new tree a batch to a transaction (see
        /// [`WorkbenchStore::create_tree`](super::workbench::WorkbenchStore::create_tree)).
        /// `tree` is set once the tree is committed, also when a later batch fails: the
        /// caller deletes it then.
        async fn write_tree(
            pool: &sqlx::Pool<$db>,
            key_id: i64,
            title: &str,
            nodes: &[super::workbench::TreeNode<'_>],
            max_bytes: i64,
            now: i64,
            tree: &mut Option<super::workbench::TreeRecord>,
        ) -> Result<Vec<super::workbench::NodeRecord>, StoreError> {
            let mut written: Vec<super::workbench::NodeRecord> = Vec::with_capacity(nodes.len());
            let mut batches = nodes.chunks(super::workbench::TREE_BATCH_NODES).peekable();
            while let Some(batch) = batches.next() {
                let started = std::time::Instant::now();
                let mut tx = pool.begin().await?;
                let (tree_id, fresh) = match tree.as_ref() {
                    Some(tree) => (tree.id, None),
                    None => {
                        let record: super::workbench::TreeRecord = sqlx::query_as(concat!(
                            "INSERT INTO loom_trees (key_id, title, version, created_at, updated_at) ",
                            "VALUES ($1, $2, 1, $3, $3) RETURNING ",
                            tree_columns!()
                        ))
                        .bind(key_id)
                        .bind(title)
                        .bind(now)
                        .fetch_one(&mut *tx)
                        .await?;
                        (record.id, Some(record))
                    }
                };
                for node in batch {
                    // `check_tree` made sure each parent is an earlier, written node.
                    let parent_id = node.parent.and_then(|p| written.get(p)).map(|p| p.id);
                    let record = sqlx::query_as(concat!(
                        "INSERT INTO loom_nodes (tree_id, parent_id, text, meta, bookmarked, ",
                        "pruned, version, created_at) VALUES ($1, $2, $3, $4, $5, $6, 1, $7) ",
                        "RETURNING ",
                        node_columns!()
                    ))
                    .bind(tree_id)
                    .bind(parent_id)
                    .bind(node.text)
                    .bind(node.meta)
                    .bind(node.bookmarked)
                    .bind(node.pruned)
                    .bind(now)
                    .fetch_one(&mut *tx)
                    .await?;
                    written.push(record);
                }
                within_bound(&mut tx, key_id, max_bytes).await?;
                tx.commit().await?;
                if fresh.is_some() {
                    *tree = fresh;
                }
                if batches.peek().is_some() {
                    // SQLite's writers that wait for the lock try again on a timer, not
                    // in turn: a gap as long as the batch lets them in, and keeps the
                    // tree's share of the writer at half or less.
                    tokio::time::sleep(started.elapsed()).await;
                }
            }
            Ok(written)
        }

        #[async_trait::async_trait]
        impl super::workbench::WorkbenchStore for $store {
            async fn stored_bytes(&self, key_id: i64) -> Result<i64, StoreError> {
                let bytes: Option<i64> =
                    sqlx::query_scalar("SELECT bytes FROM workbench_usage WHERE key_id = $1")
                        .bind(key_id)
                        .fetch_optional(&self.pool)
                        .await?;
                Ok(bytes.unwrap_or(0))
            }

            async fn create_item(
                &self,
                key_id: i64,
                item: &super::workbench::NewItem<'_>,
                max_bytes: i64,
                now: i64,
            ) -> Result<super::workbench::ItemRecord, StoreError> {
                let mut tx = self.pool.begin().await?;
                let created = sqlx::query_as(concat!(
                    "INSERT INTO workbench_items ",
                    "(key_id, kind, title, content, version, created_at, updated_at, expires_at) ",
                    "VALUES ($1, $2, $3, $4, 1, $5, $5, $6) RETURNING ",
                    item_columns!()
                ))
                .bind(key_id)
                .bind(item.kind)
                .bind(text_column("title", item.title)?)
                .bind(text_column("content", item.content)?)
                .bind(now)
                .bind(item.expires_at)
                .fetch_one(&mut *tx)
                .await?;
                within_bound(&mut tx, key_id, max_bytes).await?;
                tx.commit().await?;
                Ok(created)
            }

            async fn items(
                &self,
                key_id: i64,
                now: i64,
                page: &super::workbench::Page,
            ) -> Result<Vec<super::workbench::ItemSummary>, StoreError> {
                let (updated_at, id) = page.bounds();
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    item_summary_columns!(),
                    " FROM workbench_items WHERE key_id = $1 ",
                    "AND (expires_at IS NULL OR expires_at > $2) ",
                    "AND (updated_at < $3 OR (updated_at = $3 AND id < $4)) ",
                    "ORDER BY updated_at DESC, id DESC LIMIT $5"
                ))
                .bind(key_id)
                .bind(now)
                .bind(updated_at)
                .bind(id)
                .bind(i64::from(page.limit))
                .fetch_all(&self.pool)
                .await?)
            }

            async fn item(
                &self,
                key_id: i64,
                id: i64,
                now: i64,
            ) -> Result<Option<super::workbench::ItemRecord>, StoreError> {
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    item_columns!(),
                    " FROM workbench_items WHERE id = $1 AND key_id = $2 ",
                    "AND (expires_at IS NULL OR expires_at > $3)"
                ))
                .bind(id)
                .bind(key_id)
                .bind(now)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn update_item(
                &self,
                key_id: i64,
                id: i64,
                change: &super::workbench::ItemChange<'_>,
                max_bytes: i64,
                now: i64,
            ) -> Result<super::workbench::Versioned<super::workbench::ItemRecord>, StoreError> {
                let title = change.title.map(|t| text_column("title", t)).transpose()?;
                let content = change
                    .content
                    .map(|c| text_column("content", c))
                    .transpose()?;
                let mut tx = self.pool.begin().await?;
                let updated: Option<super::workbench::ItemRecord> = sqlx::query_as(concat!(
                    "UPDATE workbench_items SET title = COALESCE($1, title), ",
                    "content = COALESCE($2, content), ",
                    "expires_at = CASE WHEN CAST($3 AS BOOLEAN) THEN NULL ELSE expires_at END, ",
                    "version = version + 1, updated_at = $4 ",
                    "WHERE id = $5 AND key_id = $6 AND version = $7 ",
                    "AND (expires_at IS NULL OR expires_at > $4) RETURNING ",
                    item_columns!()
                ))
                .bind(title)
                .bind(content)
                .bind(change.save)
                .bind(now)
                .bind(id)
                .bind(key_id)
                .bind(change.version)
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(item) = updated {
                    // Saving a checkpoint adds nothing: only new text is held to the bound
                    // (a key over a lowered bound can still save and delete).
                    if change.title.is_some() || change.content.is_some() {
                        within_bound(&mut tx, key_id, max_bytes).await?;
                    }
                    tx.commit().await?;
                    return Ok(super::workbench::Versioned::Changed(item));
                }
                drop(tx);
                Ok(match self.item(key_id, id, now).await? {
                    Some(item) => super::workbench::Versioned::Stale {
                        current: item.version,
                    },
                    None => super::workbench::Versioned::Missing,
                })
            }

            async fn delete_item(
                &self,
                key_id: i64,
                id: i64,
                now: i64,
            ) -> Result<bool, StoreError> {
                let done = sqlx::query(concat!(
                    "DELETE FROM workbench_items WHERE id = $1 AND key_id = $2 ",
                    "AND (expires_at IS NULL OR expires_at > $3)"
                ))
                .bind(id)
                .bind(key_id)
                .bind(now)
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected() > 0)
            }

            async fn sweep_checkpoints(&self, now: i64) -> Result<u64, StoreError> {
                let done = sqlx::query(
                    "DELETE FROM workbench_items WHERE expires_at IS NOT NULL AND expires_at <= $1",
                )
                .bind(now)
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected())
            }

            async fn create_tree(
                &self,
                key_id: i64,
                title: &str,
                nodes: &[super::workbench::TreeNode<'_>],
                max_bytes: i64,
                now: i64,
            ) -> Result<
                (
                    super::workbench::TreeRecord,
                    Vec<super::workbench::NodeRecord>,
                ),
                StoreError,
            > {
                super::workbench::check_tree(nodes)?;
                let title = text_column("title", title)?;
                for node in nodes {
                    text_column("text", node.text)?;
                    text_column("meta", node.meta)?;
                }
                let mut tree = None;
                let written = write_tree(&self.pool, key_id, title, nodes, max_bytes, now, &mut tree).await;
                match (written, tree) {
                    (Ok(written), Some(tree)) => Ok((tree, written)),
                    (Ok(_), None) => Err(StoreError::Invalid("a tree needs a root node".to_owned())),
                    (Err(err), None) => Err(err),
                    (Err(err), Some(tree)) => {
                        // Some batches were committed: take them back.
                        if let Err(cleanup) = self.delete_tree(key_id, tree.id).await {
                            tracing::warn!(tree_id = tree.id, error = %cleanup, "a tree written in part could not be deleted");
                        }
                        Err(err)
                    }
                }
            }

            async fn trees(
                &self,
                key_id: i64,
                page: &super::workbench::Page,
            ) -> Result<Vec<super::workbench::TreeRecord>, StoreError> {
                let (updated_at, id) = page.bounds();
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    tree_columns!(),
                    " FROM loom_trees WHERE key_id = $1 ",
                    "AND (updated_at < $2 OR (updated_at = $2 AND id < $3)) ",
                    "ORDER BY updated_at DESC, id DESC LIMIT $4"
                ))
                .bind(key_id)
                .bind(updated_at)
                .bind(id)
                .bind(i64::from(page.limit))
                .fetch_all(&self.pool)
                .await?)
            }

            async fn tree(
                &self,
                key_id: i64,
                id: i64,
            ) -> Result<
                Option<(
                    super::workbench::TreeRecord,
                    Vec<super::workbench::NodeRecord>,
                )>,
                StoreError,
            > {
                let tree: Option<super::workbench::TreeRecord> = sqlx::query_as(concat!(
                    "SELECT ",
                    tree_columns!(),
                    " FROM loom_trees WHERE id = $1 AND key_id = $2"
                ))
                .bind(id)
                .bind(key_id)
                .fetch_optional(&self.pool)
                .await?;
                let Some(tree) = tree else {
                    return Ok(None);
                };
                let nodes = sqlx::query_as(concat!(
                    "SELECT ",
                    node_columns!(),
                    " FROM loom_nodes WHERE tree_id = $1 ORDER BY id"
                ))
                .bind(tree.id)
                .fetch_all(&self.pool)
                .await?;
                Ok(Some((tree, nodes)))
            }

            async fn rename_tree(
                &self,
                key_id: i64,
                id: i64,
                version: i64,
                title: &str,
                now: i64,
            ) -> Result<super::workbench::Versioned<super::workbench::TreeRecord>, StoreError> {
                let updated: Option<super::workbench::TreeRecord> = sqlx::query_as(concat!(
                    "UPDATE loom_trees SET title = $1, version = version + 1, updated_at = $2 ",
                    "WHERE id = $3 AND key_id = $4 AND version = $5 RETURNING ",
                    tree_columns!()
                ))
                .bind(text_column("title", title)?)
                .bind(now)
                .bind(id)
                .bind(key_id)
                .bind(version)
                .fetch_optional(&self.pool)
                .await?;
                if let Some(tree) = updated {
                    return Ok(super::workbench::Versioned::Changed(tree));
                }
                let current: Option<i64> = sqlx::query_scalar(
                    "SELECT version FROM loom_trees WHERE id = $1 AND key_id = $2",
                )
                .bind(id)
                .bind(key_id)
                .fetch_optional(&self.pool)
                .await?;
                Ok(match current {
                    Some(current) => super::workbench::Versioned::Stale { current },
                    None => super::workbench::Versioned::Missing,
                })
            }

            async fn delete_tree(&self, key_id: i64, id: i64) -> Result<bool, StoreError> {
                let done = sqlx::query("DELETE FROM loom_trees WHERE id = $1 AND key_id = $2")
                    .bind(id)
                    .bind(key_id)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() > 0)
            }

            async fn add_node(
                &self,
                key_id: i64,
                tree_id: i64,
                node: &super::workbench::NewNode<'_>,
                max_bytes: i64,
                now: i64,
            ) -> Result<super::workbench::Added, StoreError> {
                let text = text_column("text", node.text)?;
                let meta = text_column("meta", node.meta)?;
                let mut tx = self.pool.begin().await?;
                if !touch_tree(&mut tx, key_id, tree_id, now).await? {
                    return Ok(super::workbench::Added::NoTree);
                }
                let node = sqlx::query_as(concat!(
                    "INSERT INTO loom_nodes (tree_id, parent_id, text, meta, version, created_at) ",
                    "SELECT $1, id, $2, $3, 1, $4 FROM loom_nodes WHERE id = $5 AND tree_id = $1 ",
                    "RETURNING ",
                    node_columns!()
                ))
                .bind(tree_id)
                .bind(text)
                .bind(meta)
                .bind(now)
                .bind(node.parent_id)
                .fetch_optional(&mut *tx)
                .await?;
                let Some(node) = node else {
                    return Ok(super::workbench::Added::NoParent);
                };
                within_bound(&mut tx, key_id, max_bytes).await?;
                tx.commit().await?;
                Ok(super::workbench::Added::Node(node))
            }

            async fn set_node_flags(
                &self,
                key_id: i64,
                tree_id: i64,
                node_id: i64,
                flags: &super::workbench::NodeFlags,
                now: i64,
            ) -> Result<super::workbench::Versioned<super::workbench::NodeRecord>, StoreError> {
                let mut tx = self.pool.begin().await?;
                if !touch_tree(&mut tx, key_id, tree_id, now).await? {
                    return Ok(super::workbench::Versioned::Missing);
                }
                let updated: Option<super::workbench::NodeRecord> = sqlx::query_as(concat!(
                    "UPDATE loom_nodes SET ",
                    "bookmarked = COALESCE(CAST($1 AS BOOLEAN), bookmarked), ",
                    "pruned = COALESCE(CAST($2 AS BOOLEAN), pruned), version = version + 1 ",
                    "WHERE id = $3 AND tree_id = $4 AND version = $5 RETURNING ",
                    node_columns!()
                ))
                .bind(flags.bookmarked)
                .bind(flags.pruned)
                .bind(node_id)
                .bind(tree_id)
                .bind(flags.version)
                .fetch_optional(&mut *tx)
                .await?;
                let outcome = match updated {
                    Some(node) => super::workbench::Versioned::Changed(node),
                    None => {
                        let current: Option<i64> = sqlx::query_scalar(
                            "SELECT version FROM loom_nodes WHERE id = $1 AND tree_id = $2",
                        )
                        .bind(node_id)
                        .bind(tree_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                        match current {
                            Some(current) => super::workbench::Versioned::Stale { current },
                            None => super::workbench::Versioned::Missing,
                        }
                    }
                };
                // Only a change moves the tree's clock.
                if matches!(outcome, super::workbench::Versioned::Changed(_)) {
                    tx.commit().await?;
                }
                Ok(outcome)
            }
        }
    };
}
