//! The [`Store`](super::Store) methods both backends run with the same SQL and binds,
//! written once.

/// `impl Store for $store { … }` (`$db` its sqlx database): the shared methods, run on `self.pool`, plus the
/// backend's own methods (`record_usages`, `append_request_log`: each writes batches its
/// database's fastest way) passed in the braces.
///
/// A macro rather than generic functions because the SQL and binds are the same for
/// both backends but the pool types are not, and sqlx's bounds for "any database that
/// can bind and decode these types" would be longer than the queries. The expansion
/// resolves names (`KeyRecord`, `LimitColumns`…) where it is invoked, in `sqlite.rs` and
/// `postgres.rs`.
///
/// The SQL is what both databases accept: `$N` parameters (sqlx-sqlite binds `$N` to
/// argument N) and `CAST(… AS …)` rather than PostgreSQL's `::`.
macro_rules! impl_store {
    ($store:ty, $db:ty { $($own:item)* }) => {
        /// ` AND created_at_ms >= since AND created_at_ms < until`, for the bounds given.
        fn push_time_range(
            select: &mut sqlx::QueryBuilder<$db>,
            since_ms: Option<i64>,
            until_ms: Option<i64>,
        ) {
            if let Some(since) = since_ms {
                select.push(" AND created_at_ms >= ").push_bind(since);
            }
            if let Some(until) = until_ms {
                select.push(" AND created_at_ms < ").push_bind(until);
            }
        }

        #[async_trait::async_trait]
        impl Store for $store {
            fn jobs(&self) -> &dyn super::JobStore {
                self
            }

            fn workbench(&self) -> &dyn super::workbench::WorkbenchStore {
                self
            }

            async fn create_expiring_key(
                &self,
                name: &str,
                email: Option<&str>,
                key: &NewKey,
                limits: &LimitOverrides,
                expires_at: Option<i64>,
            ) -> Result<KeyRecord, StoreError> {
                let limits = LimitColumns::encode(limits)?;
                let name = text_column("name", name)?;
                let email = email.map(|email| text_column("email", email)).transpose()?;
                sqlx::query_as(concat!(
                    "INSERT INTO api_keys (name, email, prefix, key_hash, created_at, ",
                    "monthly_budget_tokens, requests_per_minute, max_concurrent, max_queued, ",
                    "share, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ",
                    "RETURNING ",
                    key_columns!()
                ))
                .bind(name)
                .bind(email)
                .bind(&key.prefix)
                .bind(key.hash.as_slice())
                .bind(now_unix())
                .bind(limits.monthly_budget)
                .bind(limits.requests_per_minute)
                .bind(limits.max_concurrent)
                .bind(limits.max_queued)
                .bind(limits.share)
                .bind(expires_at)
                .fetch_one(&self.pool)
                .await
                .map_err(|e| insert_error(e, &key.prefix))
            }

            async fn key(&self, id_or_prefix: &str) -> Result<Option<KeyRecord>, StoreError> {
                let Some((id, prefix)) = KeySelector::parse(id_or_prefix).binds() else {
                    return Ok(None);
                };
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    key_columns!(),
                    " FROM api_keys WHERE id = $1 OR prefix = $2"
                ))
                .bind(id)
                .bind(prefix)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn keys_changed_since(
                &self,
                since: i64,
            ) -> Result<Vec<KeyChange>, StoreError> {
                let rows = sqlx::query(concat!(
                    "SELECT ",
                    key_columns!(),
                    ", change_seq FROM api_keys WHERE change_seq > $1 ORDER BY change_seq"
                ))
                .bind(since)
                .fetch_all(&self.pool)
                .await?;
                rows.iter()
                    .map(|row| {
                        Ok(KeyChange {
                            record: sqlx::FromRow::from_row(row)?,
                            seq: sqlx::Row::try_get(row, "change_seq")?,
                        })
                    })
                    .collect()
            }

            async fn list_keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    key_columns!(),
                    " FROM api_keys ORDER BY id"
                ))
                .fetch_all(&self.pool)
                .await?)
            }

            async fn revoke_key(
                &self,
                id_or_prefix: &str,
            ) -> Result<Option<KeyRecord>, StoreError> {
                let Some((id, prefix)) = KeySelector::parse(id_or_prefix).binds() else {
                    return Ok(None);
                };
                Ok(sqlx::query_as(concat!(
                    "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $1) ",
                    "WHERE id = $2 OR prefix = $3 RETURNING ",
                    key_columns!()
                ))
                .bind(now_unix())
                .bind(id)
                .bind(prefix)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn set_limits(
                &self,
                id_or_prefix: &str,
                update: &LimitUpdate,
            ) -> Result<Option<KeyRecord>, StoreError> {
                let update = UpdateColumns::encode(update)?;
                let Some((id, prefix)) = KeySelector::parse(id_or_prefix).binds() else {
                    return Ok(None);
                };
                // The casts give PostgreSQL the parameters' types; on SQLite they change nothing
                // (the values bound are already 0/1, integers or NULL).
                Ok(sqlx::query_as(concat!(
                    "UPDATE api_keys SET ",
                    "monthly_budget_tokens = CASE WHEN CAST($1 AS BOOLEAN) ",
                    "THEN CAST($2 AS BIGINT) ELSE monthly_budget_tokens END, ",
                    "requests_per_minute = CASE WHEN CAST($3 AS BOOLEAN) ",
                    "THEN CAST($4 AS INTEGER) ELSE requests_per_minute END, ",
                    "max_concurrent = CASE WHEN CAST($5 AS BOOLEAN) ",
                    "THEN CAST($6 AS INTEGER) ELSE max_concurrent END, ",
                    "max_queued = CASE WHEN CAST($7 AS BOOLEAN) ",
                    "THEN CAST($8 AS INTEGER) ELSE max_queued END, ",
                    "share = CASE WHEN CAST($9 AS BOOLEAN) ",
                    "THEN CAST($10 AS INTEGER) ELSE share END ",
                    "WHERE id = $11 OR prefix = $12 RETURNING ",
                    key_columns!()
                ))
                .bind(update.monthly_budget.0)
                .bind(update.monthly_budget.1)
                .bind(update.requests_per_minute.0)
                .bind(update.requests_per_minute.1)
                .bind(update.max_concurrent.0)
                .bind(update.max_concurrent.1)
                .bind(update.max_queued.0)
                .bind(update.max_queued.1)
                .bind(update.share.0)
                .bind(update.share.1)
                .bind(id)
                .bind(prefix)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn rotate_key(
                &self,
                id_or_prefix: &str,
                hash: &[u8; 32],
                previous_until: Option<i64>,
            ) -> Result<Option<KeyRecord>, StoreError> {
                let Some((id, prefix)) = KeySelector::parse(id_or_prefix).binds() else {
                    return Ok(None);
                };
                // Every right-hand side reads the row as it was: `previous_key_hash`
                // takes the hash being replaced.
                Ok(sqlx::query_as(concat!(
                    "UPDATE api_keys SET ",
                    "previous_key_hash = CASE WHEN CAST($1 AS BIGINT) IS NULL ",
                    "THEN NULL ELSE key_hash END, ",
                    "previous_expires_at = CAST($1 AS BIGINT), key_hash = $2 ",
                    "WHERE id = $3 OR prefix = $4 RETURNING ",
                    key_columns!()
                ))
                .bind(previous_until)
                .bind(hash.as_slice())
                .bind(id)
                .bind(prefix)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn set_expiry(
                &self,
                id_or_prefix: &str,
                expires_at: Option<i64>,
            ) -> Result<Option<KeyRecord>, StoreError> {
                let Some((id, prefix)) = KeySelector::parse(id_or_prefix).binds() else {
                    return Ok(None);
                };
                Ok(sqlx::query_as(concat!(
                    "UPDATE api_keys SET expires_at = CAST($1 AS BIGINT) ",
                    "WHERE id = $2 OR prefix = $3 RETURNING ",
                    key_columns!()
                ))
                .bind(expires_at)
                .bind(id)
                .bind(prefix)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn month_usage(&self, key_id: i64, month: &str) -> Result<u64, StoreError> {
                // PostgreSQL's SUM of BIGINT is NUMERIC: cast it back.
                let sum: i64 = sqlx::query_scalar(concat!(
                    "SELECT CAST(COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS BIGINT) ",
                    "FROM usage_ledger WHERE key_id = $1 AND month = $2"
                ))
                .bind(key_id)
                .bind(month)
                .fetch_one(&self.pool)
                .await?;
                Ok(convert(sum, "SUM(tokens)")?)
            }

            async fn requests(
                &self,
                query: &RequestQuery,
            ) -> Result<Vec<RequestLogRow>, StoreError> {
                let mut select = sqlx::QueryBuilder::<$db>::new(concat!(
                    "SELECT ",
                    request_log_columns!(),
                    " FROM request_log WHERE 1 = 1"
                ));
                if let Some(key_id) = query.key_id {
                    select.push(" AND key_id = ").push_bind(key_id);
                }
                if let Some(model) = &query.model {
                    select.push(" AND model = ").push_bind(model.as_str());
                }
                if let Some(status) = query.status {
                    let range = status.range();
                    select.push(" AND status >= ").push_bind(range.start);
                    select.push(" AND status < ").push_bind(range.end);
                }
                push_time_range(&mut select, query.since_ms, query.until_ms);
                select
                    .push(" ORDER BY created_at_ms DESC, id DESC LIMIT ")
                    .push_bind(i64::from(query.limit));
                Ok(select.build_query_as().fetch_all(&self.pool).await?)
            }

            async fn delete_requests_before(
                &self,
                before_ms: i64,
                limit: u32,
            ) -> Result<u64, StoreError> {
                // By `id` through the `created_at_ms` index: both databases take a
                // `LIMIT` in a subquery, neither in a `DELETE` of their own.
                let done = sqlx::query(concat!(
                    "DELETE FROM request_log WHERE id IN (SELECT id FROM request_log ",
                    "WHERE created_at_ms < $1 ORDER BY created_at_ms LIMIT $2)"
                ))
                .bind(before_ms)
                .bind(i64::from(limit))
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected())
            }

            async fn spend(&self, query: &SpendQuery) -> Result<Vec<SpendRow>, StoreError> {
                // PostgreSQL's SUM of BIGINT is NUMERIC: cast it back.
                let mut select = sqlx::QueryBuilder::<$db>::new(concat!(
                    "SELECT CAST(created_at_ms / 86400000 AS BIGINT) AS day, key_id, ",
                    "MAX(key_prefix), model, CAST(COUNT(*) AS BIGINT), ",
                    "CAST(COALESCE(SUM(prompt_tokens), 0) AS BIGINT), ",
                    "CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT) ",
                    "FROM request_log WHERE key_id IS NOT NULL"
                ));
                if let Some(key_id) = query.key_id {
                    select.push(" AND key_id = ").push_bind(key_id);
                }
                push_time_range(&mut select, query.since_ms, query.until_ms);
                select.push(" GROUP BY day, key_id, model ORDER BY day, key_id, model");
                let rows: Vec<(i64, i64, Option<String>, Option<String>, i64, i64, i64)> =
                    select.build_query_as().fetch_all(&self.pool).await?;
                rows.into_iter()
                    .map(|(day, key_id, key_prefix, model, requests, prompt, completion)| {
                        Ok(SpendRow {
                            day,
                            key_id,
                            key_prefix,
                            model,
                            requests: convert(requests, "COUNT(*)")?,
                            prompt_tokens: convert(prompt, "SUM(prompt_tokens)")?,
                            completion_tokens: convert(completion, "SUM(completion_tokens)")?,
                        })
                    })
                    .collect()
            }

            async fn ping(&self) -> Result<(), StoreError> {
                sqlx::query("SELECT 1").execute(&self.pool).await?;
                Ok(())
            }

            $($own)*
        }
    };
}
