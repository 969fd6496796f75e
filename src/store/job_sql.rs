//! The [`JobStore`](super::JobStore) SQL, written once for both backends (see
//! `shared.rs` for why a macro). The differences: the claim's row lock (PostgreSQL's
//! `FOR UPDATE SKIP LOCKED` lets replicas claim side by side without waiting on each
//! other's rows; SQLite has one writer, so its claim is atomic as is), and PostgreSQL
//! announcing each job's end (`NOTIFY fleetgate_jobs`) to the other replicas'
//! long-polls.

/// The columns of `jobs`, as [`JobRow`](super::JobRow)'s `FromRow` reads them.
macro_rules! job_columns {
    () => {
        "id, key_id, model, status, idempotency_key, request_hash, request, \
         result, result_status, error_code, prompt_tokens, completion_tokens, attempts, \
         lease_owner, lease_until_ms, run_after_ms, cancel_requested, created_at_ms, \
         started_at_ms, finished_at_ms, expires_at_ms"
    };
}

/// [`job_columns`] for a list: no request, and a result only when it is a failed run's
/// error envelope (what a job in a list shows); never the bodies of a key's jobs.
macro_rules! job_list_columns {
    () => {
        "id, key_id, model, status, idempotency_key, request_hash, \
         CASE WHEN FALSE THEN request END AS request, \
         CASE WHEN status = 'failed' THEN result END AS result, \
         result_status, error_code, prompt_tokens, completion_tokens, attempts, \
         lease_owner, lease_until_ms, run_after_ms, cancel_requested, created_at_ms, \
         started_at_ms, finished_at_ms, expires_at_ms"
    };
}

/// `impl JobStore for $store`, `$db` its sqlx database, `$lock` the claim's row lock,
/// `$announce` a statement run with the job's id in the transaction that ends it (`""`:
/// none), and the backend's own methods in the braces.
macro_rules! impl_job_store {
    ($store:ty, $db:ty, $lock:literal, $announce:literal { $($own:item)* }) => {
        #[async_trait::async_trait]
        impl super::JobStore for $store {
            $($own)*

            async fn insert(
                &self,
                job: &super::NewJob,
            ) -> Result<super::Inserted, super::StoreError> {
                let created: Option<super::JobRow> = sqlx::query_as(concat!(
                    "INSERT INTO jobs (id, key_id, model, status, idempotency_key, ",
                    "request_hash, request, request_bytes, run_after_ms, created_at_ms, ",
                    "expires_at_ms) VALUES ($1, $2, $3, 'queued', $4, $5, $6, $7, $8, $8, $9) ",
                    "ON CONFLICT (key_id, idempotency_key) WHERE idempotency_key IS NOT NULL ",
                    "DO NOTHING RETURNING ",
                    job_columns!()
                ))
                .bind(&job.id)
                .bind(job.key_id)
                .bind(&job.model)
                .bind(job.idempotency_key.as_deref())
                .bind(job.request_hash.as_slice())
                .bind(job.request.as_slice())
                .bind(i64::try_from(job.request.len()).unwrap_or(i64::MAX))
                .bind(job.created_at_ms)
                .bind(job.expires_at_ms)
                .fetch_optional(&self.pool)
                .await?;
                if let Some(row) = created {
                    return Ok(super::Inserted::Created(row));
                }
                // Lost a race with the same key's other submission: that one is the job.
                let existing = match &job.idempotency_key {
                    Some(key) => self.by_idempotency_key(job.key_id, key).await?,
                    None => None,
                };
                existing
                    .map(super::Inserted::Existing)
                    .ok_or_else(|| super::StoreError::Invalid(format!("job id {} taken", job.id)))
            }

            async fn by_idempotency_key(
                &self,
                key_id: i64,
                idempotency_key: &str,
            ) -> Result<Option<super::JobRow>, super::StoreError> {
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    job_columns!(),
                    " FROM jobs WHERE key_id = $1 AND idempotency_key = $2"
                ))
                .bind(key_id)
                .bind(idempotency_key)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn job(
                &self,
                key_id: i64,
                id: &str,
            ) -> Result<Option<super::JobRow>, super::StoreError> {
                Ok(sqlx::query_as(concat!(
                    "SELECT ",
                    job_columns!(),
                    " FROM jobs WHERE id = $1 AND key_id = $2"
                ))
                .bind(id)
                .bind(key_id)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn any_job(&self, id: &str) -> Result<Option<super::JobRow>, super::StoreError> {
                Ok(sqlx::query_as(concat!("SELECT ", job_columns!(), " FROM jobs WHERE id = $1"))
                    .bind(id)
                    .fetch_optional(&self.pool)
                    .await?)
            }

            async fn list(
                &self,
                query: &super::JobQuery,
            ) -> Result<Vec<super::JobRow>, super::StoreError> {
                let mut select = sqlx::QueryBuilder::<$db>::new(concat!(
                    "SELECT ",
                    job_list_columns!(),
                    " FROM jobs WHERE TRUE"
                ));
                if let Some(key_id) = query.key_id {
                    select.push(" AND key_id = ").push_bind(key_id);
                }
                if let Some(status) = query.status {
                    select.push(" AND status = ").push_bind(status.as_str());
                }
                if let Some(after) = &query.after {
                    select.push(" AND id < ").push_bind(after.as_str());
                }
                select
                    .push(" ORDER BY id DESC LIMIT ")
                    .push_bind(i64::from(query.limit));
                Ok(select.build_query_as().fetch_all(&self.pool).await?)
            }

            async fn pending(&self, key_id: i64) -> Result<super::Pending, super::StoreError> {
                // Over the partial index `jobs_pending_by_key` (migration 0006) alone.
                let (jobs, bytes): (i64, i64) = sqlx::query_as(concat!(
                    "SELECT COUNT(*), CAST(COALESCE(SUM(request_bytes), 0) AS BIGINT) ",
                    "FROM jobs WHERE key_id = $1 AND status IN ('queued', 'running')"
                ))
                .bind(key_id)
                .fetch_one(&self.pool)
                .await?;
                Ok(super::Pending {
                    jobs: u64::try_from(jobs).unwrap_or(0),
                    bytes: u64::try_from(bytes).unwrap_or(0),
                })
            }

            async fn claim(
                &self,
                owner: &str,
                now_ms: i64,
                lease_ms: i64,
            ) -> Result<Option<super::JobRow>, super::StoreError> {
                Ok(sqlx::query_as(concat!(
                    "UPDATE jobs SET status = 'running', attempts = attempts + 1, ",
                    "lease_owner = $1, lease_until_ms = $2 + $3, ",
                    "started_at_ms = COALESCE(started_at_ms, $2) ",
                    "WHERE id = (SELECT id FROM jobs WHERE ",
                    "(status = 'queued' AND run_after_ms <= $2 AND expires_at_ms > $2) ",
                    "OR (status = 'running' AND lease_until_ms < $2) ",
                    "ORDER BY run_after_ms, id LIMIT 1",
                    $lock,
                    ") RETURNING ",
                    job_columns!()
                ))
                .bind(owner)
                .bind(now_ms)
                .bind(lease_ms)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn renew(
                &self,
                id: &str,
                attempt: i64,
                until_ms: i64,
            ) -> Result<Option<bool>, super::StoreError> {
                let cancel: Option<i64> = sqlx::query_scalar(concat!(
                    "UPDATE jobs SET lease_until_ms = $3 ",
                    "WHERE id = $1 AND attempts = $2 AND status = 'running' ",
                    "RETURNING cancel_requested"
                ))
                .bind(id)
                .bind(attempt)
                .bind(until_ms)
                .fetch_optional(&self.pool)
                .await?;
                Ok(cancel.map(|c| c != 0))
            }

            async fn finish(
                &self,
                id: &str,
                attempt: i64,
                outcome: &super::JobOutcome,
                now_ms: i64,
            ) -> Result<bool, super::StoreError> {
                let tokens = |n: Option<u64>| n.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
                let mut tx = self.pool.begin().await?;
                let done = sqlx::query(concat!(
                    "UPDATE jobs SET status = $3, result = $4, result_status = $5, ",
                    "error_code = $6, prompt_tokens = $7, completion_tokens = $8, ",
                    "finished_at_ms = $9, lease_owner = NULL, lease_until_ms = NULL ",
                    "WHERE id = $1 AND attempts = $2 AND status = 'running'"
                ))
                .bind(id)
                .bind(attempt)
                .bind(outcome.status.as_str())
                .bind(outcome.result.as_deref())
                .bind(outcome.result_status.map(i64::from))
                .bind(outcome.error_code.as_deref())
                .bind(tokens(outcome.prompt_tokens))
                .bind(tokens(outcome.completion_tokens))
                .bind(now_ms)
                .execute(&mut *tx)
                .await?;
                if done.rows_affected() != 1 {
                    return Ok(false);
                }
                if let Some(row) = &outcome.charge {
                    let counts = UsageColumns::encode(row)?;
                    sqlx::query(
                        "INSERT INTO usage_ledger (key_id, request_id, month, prompt_tokens, \
                         completion_tokens, created_at) VALUES ($1, $2, $3, $4, $5, $6) \
                         ON CONFLICT (request_id) DO UPDATE SET month = excluded.month, \
                         prompt_tokens = excluded.prompt_tokens, \
                         completion_tokens = excluded.completion_tokens, \
                         created_at = excluded.created_at",
                    )
                    .bind(row.key_id)
                    .bind(row.request_id.as_str())
                    .bind(row.month.as_str())
                    .bind(counts.prompt_tokens)
                    .bind(counts.completion_tokens)
                    .bind(row.created_at)
                    .execute(&mut *tx)
                    .await?;
                }
                if !$announce.is_empty() {
                    sqlx::query($announce).bind(id).execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(true)
            }

            async fn requeue(
                &self,
                id: &str,
                attempt: i64,
                run_after_ms: i64,
                now_ms: i64,
            ) -> Result<bool, super::StoreError> {
                // A cancel asked for meanwhile ends the job rather than queue it.
                let done = sqlx::query(concat!(
                    "UPDATE jobs SET ",
                    "status = CASE WHEN cancel_requested = 1 THEN 'cancelled' ELSE 'queued' END, ",
                    "finished_at_ms = CASE WHEN cancel_requested = 1 THEN $4 ELSE NULL END, ",
                    "lease_owner = NULL, lease_until_ms = NULL, run_after_ms = $3 ",
                    "WHERE id = $1 AND attempts = $2 AND status = 'running'"
                ))
                .bind(id)
                .bind(attempt)
                .bind(run_after_ms)
                .bind(now_ms)
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn cancel(
                &self,
                key_id: i64,
                id: &str,
                now_ms: i64,
            ) -> Result<Option<super::JobRow>, super::StoreError> {
                // Every SET expression sees the row as it was: a queued job ends now, a
                // running one is flagged for its worker, an ended one is left alone.
                Ok(sqlx::query_as(concat!(
                    "UPDATE jobs SET ",
                    "status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END, ",
                    "finished_at_ms = CASE WHEN status = 'queued' THEN $3 ELSE finished_at_ms END, ",
                    "cancel_requested = CASE WHEN status = 'running' THEN 1 ELSE cancel_requested END ",
                    "WHERE id = $1 AND key_id = $2 RETURNING ",
                    job_columns!()
                ))
                .bind(id)
                .bind(key_id)
                .bind(now_ms)
                .fetch_optional(&self.pool)
                .await?)
            }

            async fn ended(&self, ids: &[String]) -> Result<Vec<String>, super::StoreError> {
                if ids.is_empty() {
                    return Ok(Vec::new());
                }
                let mut select = sqlx::QueryBuilder::<$db>::new(
                    "SELECT id FROM jobs WHERE finished_at_ms IS NOT NULL AND id IN (",
                );
                let mut list = select.separated(", ");
                for id in ids {
                    list.push_bind(id.as_str());
                }
                select.push(")");
                Ok(select.build_query_scalar().fetch_all(&self.pool).await?)
            }

            async fn status_counts(
                &self,
            ) -> Result<Vec<(super::JobStatus, u64)>, super::StoreError> {
                let rows: Vec<(String, i64)> =
                    sqlx::query_as("SELECT status, COUNT(*) FROM jobs GROUP BY status")
                        .fetch_all(&self.pool)
                        .await?;
                Ok(rows
                    .into_iter()
                    .filter_map(|(status, n)| {
                        Some((super::JobStatus::parse(&status)?, u64::try_from(n).ok()?))
                    })
                    .collect())
            }

            async fn sweep(
                &self,
                retention: super::Retention,
            ) -> Result<super::Swept, super::StoreError> {
                let now = retention.now_ms;
                let expired = sqlx::query(
                    "UPDATE jobs SET status = 'expired', finished_at_ms = $1, request = NULL \
                     WHERE status = 'queued' AND expires_at_ms <= $1",
                )
                .bind(now)
                .execute(&self.pool)
                .await?
                .rows_affected();
                let purged = sqlx::query(
                    "UPDATE jobs SET request = NULL, result = NULL \
                     WHERE finished_at_ms <= $1 AND (request IS NOT NULL OR result IS NOT NULL)",
                )
                .bind(now.saturating_sub(retention.content_ttl_ms))
                .execute(&self.pool)
                .await?
                .rows_affected();
                // A job's accounting is settled when it ends (its charge commits with its
                // end), so its row may go once the metadata's time is up.
                let deleted = sqlx::query("DELETE FROM jobs WHERE finished_at_ms <= $1")
                .bind(now.saturating_sub(retention.metadata_ttl_ms))
                .execute(&self.pool)
                .await?
                .rows_affected();
                Ok(super::Swept {
                    expired,
                    purged,
                    deleted,
                })
            }
        }
    };
}
