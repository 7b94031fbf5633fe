//! Jobs: admission (identity through the UNIQUE constraint), the views operators
//! and owners read, and cancellation.

use super::outbox::outbox_message;
use super::*;

impl Store {
    /// Turns validated intents into jobs. Identity is decided by the UNIQUE
    /// constraint through `INSERT … ON CONFLICT DO NOTHING`, never by a check first;
    /// the job, its first attempt and the attempt's outbox row commit together.
    pub async fn admit(&self, batch: &[NewJob]) -> Result<Vec<Admission>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.retrying(|| self.admit_once(batch)).await
    }

    async fn admit_once(&self, batch: &[NewJob]) -> Result<Vec<Admission>> {
        // Rows are inserted in identity order, so that batches which overlap take
        // their locks in one order and do not deadlock; within a batch, the first
        // intent of an identity stays first (the sort is stable).
        let mut sorted: Vec<&NewJob> = batch.iter().collect();
        sorted.sort_by(|a, b| {
            (&a.intent.owner_id, &a.intent.idempotency_key)
                .cmp(&(&b.intent.owner_id, &b.intent.idempotency_key))
        });
        let mut tx = self.pool.begin().await?;
        let created: Vec<(Uuid, Uuid, String)> = sqlx::query_as(
            "WITH input AS (
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                                      $6::jsonb[], $7::text[], $8::uuid[], $9::text[])
                     WITH ORDINALITY
                     AS t(job_id, owner_id, idempotency_key, fingerprint, operation, input, pinned,
                          attempt_id, provider, position)
             ), new_jobs AS (
                 INSERT INTO jobs (id, owner_id, idempotency_key, request_fingerprint, operation, input, provider)
                 SELECT job_id, owner_id, idempotency_key, fingerprint, operation, input, pinned
                 FROM input ORDER BY position
                 ON CONFLICT (owner_id, idempotency_key) DO NOTHING
                 RETURNING id
             )
             INSERT INTO attempts (id, job_id, number, provider)
             SELECT i.attempt_id, i.job_id, 1, i.provider FROM input i JOIN new_jobs n ON n.id = i.job_id
             RETURNING job_id, id, provider",
        )
        .bind(sorted.iter().map(|n| n.job_id.0).collect::<Vec<_>>())
        .bind(sorted.iter().map(|n| n.intent.owner_id.clone()).collect::<Vec<_>>())
        .bind(sorted.iter().map(|n| n.intent.idempotency_key.clone()).collect::<Vec<_>>())
        .bind(sorted.iter().map(|n| n.fingerprint.0.clone()).collect::<Vec<_>>())
        .bind(sorted.iter().map(|n| n.intent.operation.clone()).collect::<Vec<_>>())
        .bind(sorted.iter().map(|n| Value::Object(n.intent.input.clone())).collect::<Vec<_>>())
        .bind(sorted.iter().map(|n| n.intent.provider.clone()).collect::<Vec<_>>())
        .bind(sorted.iter().map(|n| n.attempt_id.0).collect::<Vec<_>>())
        .bind(sorted.iter().map(|n| n.provider.clone()).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await?;

        let drafts: Vec<OutboxDraft> = created
            .iter()
            .map(|(job, attempt, provider)| {
                self.routes
                    .attempt_draft(AttemptId(*attempt), JobId(*job), provider, None)
            })
            .collect();
        let mut publish_by_attempt: HashMap<String, OutboxMessage> = self
            .insert_outbox(&mut tx, &drafts)
            .await?
            .into_iter()
            .map(|m| (m.message_id.clone(), m))
            .collect();
        let mut publish_by_job: HashMap<Uuid, OutboxMessage> = HashMap::new();
        for (job, attempt, _) in &created {
            let message = publish_by_attempt
                .remove(&attempt.to_string())
                .ok_or_else(|| corrupt(format!("no outbox row for attempt {attempt}")))?;
            publish_by_job.insert(*job, message);
        }

        // A separate statement takes a fresh snapshot, so it sees rows that a
        // concurrent transaction committed while our INSERT waited on the conflict.
        let existing: Vec<(String, String, Uuid, String)> = sqlx::query_as(
            "SELECT j.owner_id, j.idempotency_key, j.id, j.request_fingerprint
             FROM jobs j
             JOIN unnest($1::text[], $2::text[]) AS i(owner_id, idempotency_key)
               ON j.owner_id = i.owner_id AND j.idempotency_key = i.idempotency_key",
        )
        .bind(
            batch
                .iter()
                .map(|n| n.intent.owner_id.clone())
                .collect::<Vec<_>>(),
        )
        .bind(
            batch
                .iter()
                .map(|n| n.intent.idempotency_key.clone())
                .collect::<Vec<_>>(),
        )
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;

        let existing: HashMap<(String, String), (Uuid, String)> = existing
            .into_iter()
            .map(|(o, k, id, fp)| ((o, k), (id, fp)))
            .collect();
        // A job that bears this batch's own id was created by an earlier run of
        // this call whose commit went through unseen (the connection dropped at
        // COMMIT, and `retrying` ran it again): it is still `created`, with the
        // outbox row that run wrote.
        let unseen: Vec<String> = batch
            .iter()
            .filter(|n| {
                !publish_by_job.contains_key(&n.job_id.0)
                    && existing
                        .get(&(n.intent.owner_id.clone(), n.intent.idempotency_key.clone()))
                        .is_some_and(|(id, _)| *id == n.job_id.0)
            })
            .map(|n| n.attempt_id.to_string())
            .collect();
        if !unseen.is_empty() {
            let rows = sqlx::query(
                "SELECT id, exchange, routing_key, message_id, body FROM outbox
                 WHERE message_id = ANY($1)",
            )
            .bind(&unseen)
            .fetch_all(&self.pool)
            .await?;
            let by_attempt: HashMap<String, OutboxMessage> = rows
                .iter()
                .map(|r| outbox_message(r).map(|m| (m.message_id.clone(), m)))
                .collect::<Result<_>>()?;
            for n in batch {
                if let Some(m) = by_attempt.get(&n.attempt_id.to_string()) {
                    publish_by_job.insert(n.job_id.0, m.clone());
                }
            }
        }
        batch
            .iter()
            .map(|n| {
                if let Some(publish) = publish_by_job.remove(&n.job_id.0) {
                    return Ok(Admission::Created {
                        job_id: n.job_id,
                        publish,
                    });
                }
                let key = (n.intent.owner_id.clone(), n.intent.idempotency_key.clone());
                match existing.get(&key) {
                    Some((id, fp)) if *fp == n.fingerprint.0 => {
                        Ok(Admission::Duplicate { job_id: JobId(*id) })
                    }
                    Some(_) => Ok(Admission::Conflict),
                    None => Err(corrupt(format!(
                        "job for owner {:?} key {:?} neither inserted nor found",
                        n.intent.owner_id, n.intent.idempotency_key
                    ))),
                }
            })
            .collect()
    }

    /// Where an attempt stands: its job, its status, and its job's status.
    pub async fn attempt_state(
        &self,
        attempt: AttemptId,
    ) -> Result<Option<(JobId, AttemptStatus, JobStatus)>> {
        let row: Option<(Uuid, String, String)> = sqlx::query_as(
            "SELECT a.job_id, a.status, j.status FROM attempts a JOIN jobs j ON j.id = a.job_id
             WHERE a.id = $1",
        )
        .bind(attempt.0)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|(job, a, j)| {
            Ok((
                JobId(job),
                a.parse().map_err(corrupt)?,
                j.parse().map_err(corrupt)?,
            ))
        })
        .transpose()
    }

    /// The job an attempt belongs to.
    pub async fn attempt_job(&self, attempt: AttemptId) -> Result<Option<JobId>> {
        let row: Option<(Uuid,)> = sqlx::query_as("SELECT job_id FROM attempts WHERE id = $1")
            .bind(attempt.0)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|(id,)| JobId(id)))
    }

    /// A job with its attempts.
    pub async fn job(&self, id: JobId) -> Result<Option<JobView>> {
        let row = sqlx::query("SELECT * FROM jobs WHERE id = $1")
            .bind(id.0)
            .fetch_optional(&self.pool)
            .await?;
        self.view(row).await
    }

    /// A job with its attempts, only if it belongs to `owner_id`: the owner check
    /// is part of the query, so another owner's job is never even read.
    pub async fn owned_job(&self, id: JobId, owner_id: &str) -> Result<Option<JobView>> {
        let row = sqlx::query("SELECT * FROM jobs WHERE id = $1 AND owner_id = $2")
            .bind(id.0)
            .bind(owner_id)
            .fetch_optional(&self.pool)
            .await?;
        self.view(row).await
    }

    /// The job with this identity, if any.
    pub async fn find_job(&self, owner_id: &str, idempotency_key: &str) -> Result<Option<JobView>> {
        let row = sqlx::query("SELECT * FROM jobs WHERE owner_id = $1 AND idempotency_key = $2")
            .bind(owner_id)
            .bind(idempotency_key)
            .fetch_optional(&self.pool)
            .await?;
        self.view(row).await
    }

    async fn view(&self, row: Option<sqlx::postgres::PgRow>) -> Result<Option<JobView>> {
        let Some(row) = row else {
            return Ok(None);
        };
        let id: Uuid = row.try_get("id")?;
        let attempts = sqlx::query("SELECT * FROM attempts WHERE job_id = $1 ORDER BY number")
            .bind(id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|a| {
                Ok(AttemptView {
                    id: AttemptId(a.try_get("id")?),
                    job_id: JobId(a.try_get("job_id")?),
                    number: a.try_get("number")?,
                    provider: a.try_get("provider")?,
                    status: a.try_get::<String, _>("status")?.parse().map_err(corrupt)?,
                    error: a.try_get("error")?,
                    created_at: a.try_get("created_at")?,
                    not_before: a.try_get("not_before")?,
                    started_at: a.try_get("started_at")?,
                    finished_at: a.try_get("finished_at")?,
                    provider_request_id: a.try_get("provider_request_id")?,
                    usage: a.try_get("usage")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(JobView {
            id: JobId(id),
            owner_id: row.try_get("owner_id")?,
            idempotency_key: row.try_get("idempotency_key")?,
            request_fingerprint: row.try_get("request_fingerprint")?,
            operation: row.try_get("operation")?,
            input: row.try_get("input")?,
            provider: row.try_get("provider")?,
            status: row
                .try_get::<String, _>("status")?
                .parse()
                .map_err(corrupt)?,
            version: row.try_get("version")?,
            completed_by: row
                .try_get::<Option<Uuid>, _>("completed_by")?
                .map(AttemptId),
            result: row.try_get("result")?,
            error: row.try_get("error")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            attempts,
        }))
    }

    /// Cancels a job: the version is bumped, queued and unknown attempts are
    /// cancelled, and an attempt still in flight is left to finish, so that its late
    /// result is `discarded` by the compare-and-swap. Refused on a terminal job.
    pub async fn cancel_job(&self, job: JobId) -> Result<Result<Vec<OutboxMessage>, Refusal>> {
        let Some((status,)) =
            sqlx::query_as::<_, (String,)>("SELECT status FROM jobs WHERE id = $1")
                .bind(job.0)
                .fetch_optional(&self.pool)
                .await?
        else {
            return Ok(Err(Refusal::NotFound(format!("job {job}"))));
        };
        let status: JobStatus = status.parse().map_err(corrupt)?;
        if status.is_terminal() {
            return Ok(Err(Refusal::terminal_job(job, status)));
        }
        let reason = "cancelled: by an operator";
        Ok(self
            .retrying(|| self.cancel_once(job, None, reason))
            .await?
            .ok_or_else(|| {
                Refusal::Terminal(format!(
                    "job {job} ended while it was being cancelled; look again"
                ))
            }))
    }

    /// One cancellation transaction; `None` if the job had already ended.
    pub(super) async fn cancel_once(
        &self,
        job: JobId,
        target: Option<AttemptId>,
        reason: &str,
    ) -> Result<Option<Vec<OutboxMessage>>> {
        let mut tx = self.pool.begin().await?;
        // The job first: once it is locked and cancelled, no retry or hedge can add
        // an attempt to it (they lock the job before they insert one), and the
        // statement below, with its fresh snapshot, sees every attempt it has.
        let rows = sqlx::query(
            "UPDATE jobs j
             SET status = 'cancelled', version = j.version + 1, updated_at = now(), error = $2
             WHERE j.id = $1 AND j.status IN ('queued', 'running', 'unknown')
             RETURNING j.id, j.version, j.owner_id, j.idempotency_key, j.operation,
                       j.status, j.completed_by, j.result, j.error",
        )
        .bind(job.0)
        .bind(reason)
        .fetch_all(&mut *tx)
        .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        sqlx::query(
            "UPDATE attempts SET status = 'cancelled', finished_at = now(),
                    error = CASE WHEN id = $2 THEN 'cancelled: resolved as cancelled by an operator'
                                 ELSE 'cancelled: its job was cancelled' END
             WHERE job_id = $1
               AND (status IN ('queued', 'unknown') OR (id = $2 AND status = 'started'))",
        )
        .bind(job.0)
        .bind(target.map(|a| a.0))
        .execute(&mut *tx)
        .await?;
        let draft = Ended::from_row(row)?.draft(&self.routes);
        let publish = self.insert_outbox(&mut tx, &[draft]).await?;
        tx.commit().await?;
        Ok(Some(publish))
    }
}
