//! [`WorkbenchStore`](super::workbench::WorkbenchStore) for both backends, with the same
//! SQL and binds, written once (as `shared.rs` does for the `Store`, and for the same
//! reason: the pool types differ, the queries do not).
//!
//! Ownership is in the SQL: every statement names the key, items and trees directly,
//! nodes through their tree. Booleans are bound as `bool` and read back as `bool`:
//! `BOOLEAN` in PostgreSQL, `INTEGER` 0/1 in SQLite.

/// The columns of `workbench_items`, in [`ItemRecord`](super::workbench::ItemRecord) order.
macro_rules! item_columns {
    () => {
        "id, kind, title, content, version, created_at, updated_at, expires_at"
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

        #[async_trait::async_trait]
        impl super::workbench::WorkbenchStore for $store {
            async fn create_item(
                &self,
                key_id: i64,
                item: &super::workbench::NewItem<'_>,
                now: i64,
            ) -> Result<super::workbench::ItemRecord, StoreError> {
                Ok(sqlx::query_as(concat!(
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
                .fetch_one(&self.pool)
                .await?)
            }

            async fn items(
                &self,
                key_id: i64,
                now: i64,
            ) -> Result<Vec<super::workbench::ItemRecord>, StoreError> {
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    item_columns!(),
                    " FROM workbench_items WHERE key_id = $1 ",
                    "AND (expires_at IS NULL OR expires_at > $2) ",
                    "ORDER BY updated_at DESC, id DESC"
                ))
                .bind(key_id)
                .bind(now)
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
                now: i64,
            ) -> Result<super::workbench::Versioned<super::workbench::ItemRecord>, StoreError> {
                let title = change.title.map(|t| text_column("title", t)).transpose()?;
                let content = change
                    .content
                    .map(|c| text_column("content", c))
                    .transpose()?;
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
                .fetch_optional(&self.pool)
                .await?;
                if let Some(item) = updated {
                    return Ok(super::workbench::Versioned::Changed(item));
                }
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
                let mut tx = self.pool.begin().await?;
                let tree: super::workbench::TreeRecord = sqlx::query_as(concat!(
                    "INSERT INTO loom_trees (key_id, title, version, created_at, updated_at) ",
                    "VALUES ($1, $2, 1, $3, $3) RETURNING ",
                    tree_columns!()
                ))
                .bind(key_id)
                .bind(title)
                .bind(now)
                .fetch_one(&mut *tx)
                .await?;
                let mut written: Vec<super::workbench::NodeRecord> =
                    Vec::with_capacity(nodes.len());
                for node in nodes {
                    // `check_tree` made sure each parent is an earlier, written node.
                    let parent_id = node.parent.and_then(|p| written.get(p)).map(|p| p.id);
                    let record = sqlx::query_as(concat!(
                        "INSERT INTO loom_nodes (tree_id, parent_id, text, meta, bookmarked, ",
                        "pruned, version, created_at) VALUES ($1, $2, $3, $4, $5, $6, 1, $7) ",
                        "RETURNING ",
                        node_columns!()
                    ))
                    .bind(tree.id)
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
                tx.commit().await?;
                Ok((tree, written))
            }

            async fn trees(
                &self,
                key_id: i64,
            ) -> Result<Vec<super::workbench::TreeRecord>, StoreError> {
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    tree_columns!(),
                    " FROM loom_trees WHERE key_id = $1 ORDER BY updated_at DESC, id DESC"
                ))
                .bind(key_id)
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
                parent_id: i64,
                text: &str,
                meta: &str,
                now: i64,
            ) -> Result<super::workbench::Added, StoreError> {
                let text = text_column("text", text)?;
                let meta = text_column("meta", meta)?;
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
                .bind(parent_id)
                .fetch_optional(&mut *tx)
                .await?;
                let Some(node) = node else {
                    return Ok(super::workbench::Added::NoParent);
                };
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
