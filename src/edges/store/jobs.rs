//! Jobs: the views operators and owners read, and cancellation (admission is
//! `admission.rs`).

use crate::edges::store::handles::Jobs;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use crate::edges::store::audit;
use crate::edges::store::audit::{Action, Actor};
use crate::edges::store::drafts::{Ended, OutboxMessage};
use crate::edges::store::error::{Refusal, Result};
use crate::edges::store::views::{AttemptView, JobRow, JobView};

impl Jobs<'_> {
    /// Where an attempt stands: its job, its status, and its job's status.
    pub async fn attempt_state(
        self,
        attempt: AttemptId,
    ) -> Result<Option<(JobId, AttemptStatus, JobStatus)>> {
        let row = sqlx::query!(
            r#"SELECT a.job_id AS "job_id: JobId", a.status AS "attempt: AttemptStatus",
                      j.status AS "job: JobStatus"
               FROM attempts a JOIN jobs j ON j.id = a.job_id
               WHERE a.id = $1"#,
            attempt.0,
        )
        .fetch_optional(&self.0.pool)
        .await?;
        Ok(row.map(|r| (r.job_id, r.attempt, r.job)))
    }

    /// The job an attempt belongs to.
    pub async fn attempt_job(self, attempt: AttemptId) -> Result<Option<JobId>> {
        Ok(sqlx::query_scalar!(
            r#"SELECT job_id AS "job_id: JobId" FROM attempts WHERE id = $1"#,
            attempt.0
        )
        .fetch_optional(&self.0.pool)
        .await?)
    }

    /// A job with its attempts.
    pub async fn job(self, id: JobId) -> Result<Option<JobView>> {
        let row = sqlx::query_as!(
            JobRow,
            r#"SELECT id AS "id: JobId", owner_id, idempotency_key, request_fingerprint, operation,
                      input, provider, status AS "status: JobStatus", version,
                      completed_by AS "completed_by: AttemptId", result, error, created_at,
                      updated_at
               FROM jobs WHERE id = $1"#,
            id.0
        )
        .fetch_optional(&self.0.pool)
        .await?;
        self.view(row).await
    }

    /// A job with its attempts, only if it belongs to `owner_id`: the owner check
    /// is part of the query, so another owner's job is never even read.
    pub async fn owned_job(self, id: JobId, owner_id: &str) -> Result<Option<JobView>> {
        let row = sqlx::query_as!(
            JobRow,
            r#"SELECT id AS "id: JobId", owner_id, idempotency_key, request_fingerprint, operation,
                      input, provider, status AS "status: JobStatus", version,
                      completed_by AS "completed_by: AttemptId", result, error, created_at,
                      updated_at
               FROM jobs WHERE id = $1 AND owner_id = $2"#,
            id.0,
            owner_id
        )
        .fetch_optional(&self.0.pool)
        .await?;
        self.view(row).await
    }

    /// The job with this identity, if any.
    pub async fn find(self, owner_id: &str, idempotency_key: &str) -> Result<Option<JobView>> {
        let row = sqlx::query_as!(
            JobRow,
            r#"SELECT id AS "id: JobId", owner_id, idempotency_key, request_fingerprint, operation,
                      input, provider, status AS "status: JobStatus", version,
                      completed_by AS "completed_by: AttemptId", result, error, created_at,
                      updated_at
               FROM jobs WHERE owner_id = $1 AND idempotency_key = $2"#,
            owner_id,
            idempotency_key
        )
        .fetch_optional(&self.0.pool)
        .await?;
        self.view(row).await
    }

    async fn view(self, row: Option<JobRow>) -> Result<Option<JobView>> {
        let Some(job) = row else {
            return Ok(None);
        };
        let attempts = sqlx::query_as!(
            AttemptView,
            r#"SELECT id AS "id: AttemptId", job_id AS "job_id: JobId", number, provider,
                      status AS "status: AttemptStatus", error, created_at, not_before,
                      EXISTS (SELECT 1 FROM turns t WHERE t.attempt_id = a.id
                                                      AND t.handed_out_at IS NULL) AS "held!",
                      started_at, finished_at, provider_request_id, usage,
                      evidence_looks, evidence_last_at, evidence_note, evidence_next_at
               FROM attempts a WHERE job_id = $1 ORDER BY number"#,
            job.id.0
        )
        .fetch_all(&self.0.pool)
        .await?;
        Ok(Some(job.with(attempts)))
    }

    /// Cancels a job: the version is bumped, queued attempts are cancelled,
    /// unknown ones `discarded` (their calls may have run: evidence looks for
    /// what they cost), and an attempt still in flight is left to finish, so
    /// that its late result is `discarded` by the compare-and-swap. Refused on a terminal job.
    /// The cancellation is recorded in the audit table, in its transaction.
    pub async fn cancel(
        self,
        job: JobId,
        actor: &Actor,
    ) -> Result<Result<Vec<OutboxMessage>, Refusal>> {
        let Some(status) = sqlx::query_scalar!(
            r#"SELECT status AS "status: JobStatus" FROM jobs WHERE id = $1"#,
            job.0
        )
        .fetch_optional(&self.0.pool)
        .await?
        else {
            return Ok(Err(Refusal::NotFound(format!("job {job}"))));
        };
        if status.is_terminal() {
            return Ok(Err(Refusal::terminal_job(job, status)));
        }
        let reason = "cancelled: by an operator";
        let action = Action {
            id: Some(Uuid::now_v7()),
            action: "job.cancel",
            job: Some(job),
            ..Action::default()
        };
        match self
            .0
            .retrying(|| self.cancel_once(job, None, reason, (actor, &action)))
            .await?
        {
            Some(publish) => Ok(Ok(publish)),
            // A try whose commit reply was lost, run again, finds the job
            // ended: by this very cancellation when its audit row is there.
            // Its event is the relay's to publish.
            None if self
                .0
                .audit()
                .recorded(action.id.unwrap_or_default())
                .await?
                .is_some() =>
            {
                Ok(Ok(Vec::new()))
            }
            None => Ok(Err(Refusal::Terminal(format!(
                "job {job} ended while it was being cancelled; look again"
            )))),
        }
    }

    /// One cancellation transaction, recorded as `audit` says; `None` if the
    /// job had already ended.
    pub(super) async fn cancel_once(
        self,
        job: JobId,
        target: Option<AttemptId>,
        reason: &str,
        audit: (&Actor, &Action<'_>),
    ) -> Result<Option<Vec<OutboxMessage>>> {
        let mut tx = self.0.pool.begin().await?;
        // The job first: once it is locked and cancelled, no retry or hedge can add
        // an attempt to it (they lock the job before they insert one), and the
        // statement below, with its fresh snapshot, sees every attempt it has.
        let Some(ended) = sqlx::query_as!(
            Ended,
            r#"UPDATE jobs j
               SET status = 'cancelled', version = j.version + 1, updated_at = now(), error = $2
               WHERE j.id = $1 AND j.status IN ('queued', 'running', 'unknown')
               RETURNING j.id AS "job_id: JobId", j.version, j.owner_id, j.idempotency_key,
                         j.operation, j.status AS "status: JobStatus",
                         j.completed_by AS "completed_by: AttemptId", j.result, j.error"#,
            job.0,
            reason
        )
        .fetch_optional(&mut *tx)
        .await?
        else {
            return Ok(None);
        };
        // An unknown attempt of a cancelled job may have been run, and paid
        // for: it is `discarded`, and evidence looks for what it cost (the
        // attempt an operator resolves as cancelled is taken at their word).
        sqlx::query!(
            "UPDATE attempts
             SET status = CASE WHEN status = 'unknown' AND id IS DISTINCT FROM $2
                               THEN 'discarded' ELSE 'cancelled' END,
                 finished_at = now(),
                 evidence_next_at = CASE WHEN status = 'unknown' AND id IS DISTINCT FROM $2
                                         THEN now() ELSE evidence_next_at END,
                 error = CASE WHEN id = $2 THEN 'cancelled: resolved as cancelled by an operator'
                              WHEN status = 'unknown'
                              THEN 'discarded: its outcome was still unknown when its job was cancelled'
                              ELSE 'cancelled: its job was cancelled' END
             WHERE job_id = $1
               AND (status IN ('queued', 'unknown') OR (id = $2 AND status = 'started'))",
            job.0,
            target.map(|a| a.0) as Option<Uuid>
        )
        .execute(&mut *tx)
        .await?;
        audit::record(&mut tx, audit.0, audit.1).await?;
        let draft = ended.draft(&self.0.routes);
        let publish = self.0.outbox().insert(&mut tx, &[draft]).await?;
        tx.commit().await?;
        Ok(Some(publish))
    }
}

/// Which jobs `onejob jobs list` lists, and where its page starts. Every
/// filter given must hold; none given lists every job.
#[derive(Clone, Debug, Default)]
pub struct JobQuery {
    /// Only jobs in one of these statuses (empty: any status).
    pub statuses: Vec<JobStatus>,
    /// Only this owner's jobs.
    pub owner: Option<String>,
    /// Only jobs with an attempt on this provider.
    pub provider: Option<String>,
    /// Only jobs created longer ago than this.
    pub older_than: Option<Duration>,
    /// Only jobs created at most this long ago.
    pub newer_than: Option<Duration>,
    /// Only jobs older than this one (the last of the page before): pages go
    /// newest first, by the id (a UUIDv7, so in the order jobs were created).
    pub after: Option<JobId>,
}

/// A job as `onejob jobs list` shows it: what `jobs show` does but its input,
/// result and attempts, which it counts.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobSummary {
    /// The job id.
    pub id: JobId,
    /// Owner.
    pub owner_id: String,
    /// Idempotency key.
    pub idempotency_key: String,
    /// Fingerprint of the intent.
    pub request_fingerprint: String,
    /// Operation.
    pub operation: String,
    /// The pinned provider, if any.
    pub provider: Option<String>,
    /// Status.
    pub status: JobStatus,
    /// Version.
    pub version: i64,
    /// The winning attempt.
    pub completed_by: Option<AttemptId>,
    /// Error.
    pub error: Option<String>,
    /// How many attempts it has made.
    pub attempt_count: i64,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

/// An age longer than any job's, in seconds (1,000 years): a longer duration
/// is taken as this, which Postgres's timestamps still hold when taken from
/// now.
const AGE_CAP_SECONDS: f64 = 31_557_600_000.0;

impl Jobs<'_> {
    /// Up to `limit` jobs that `query` picks, newest first, after
    /// `query.after`: by keyset on the primary key, never by offset. Each
    /// filter not given is `NULL`, which Postgres folds away when it plans the
    /// statement for its values (as it does for a statement's first runs), so
    /// the walk backwards through the primary key (or, for a few statuses, the
    /// `jobs_status_id` index) stops once the page is full. A provider is a
    /// semi-join at the statement's top, not an `OR`, so that Postgres may
    /// walk the provider's attempts instead (`attempts_provider_job`) when few
    /// jobs used it, and look each job's up there when many did.
    pub async fn list(self, query: &JobQuery, limit: i64) -> Result<Vec<JobSummary>> {
        let statuses: Option<Vec<String>> = (!query.statuses.is_empty()).then(|| {
            query
                .statuses
                .iter()
                .map(|s| s.as_str().to_owned())
                .collect()
        });
        let age = |d: Option<Duration>| d.map(|d| d.as_secs_f64().min(AGE_CAP_SECONDS));
        let (older, newer) = (age(query.older_than), age(query.newer_than));
        let after = query.after.map(|j| j.0);
        let owner = query.owner.as_deref();
        let Some(provider) = query.provider.as_deref() else {
            return Ok(sqlx::query_as!(
                JobSummary,
                r#"SELECT j.id AS "id: JobId", j.owner_id, j.idempotency_key, j.request_fingerprint,
                          j.operation, j.provider, j.status AS "status: JobStatus", j.version,
                          j.completed_by AS "completed_by: AttemptId", j.error,
                          (SELECT count(*) FROM attempts a WHERE a.job_id = j.id) AS "attempt_count!",
                          j.created_at, j.updated_at
                   FROM jobs j
                   WHERE ($1::text[] IS NULL OR j.status = ANY($1))
                     AND ($2::text IS NULL OR j.owner_id = $2)
                     AND ($3::float8 IS NULL OR j.created_at < now() - make_interval(secs => $3))
                     AND ($4::float8 IS NULL OR j.created_at >= now() - make_interval(secs => $4))
                     AND ($5::uuid IS NULL OR j.id < $5)
                   ORDER BY j.id DESC
                   LIMIT $6"#,
                statuses.as_deref(),
                owner,
                older,
                newer,
                after,
                limit
            )
            .fetch_all(&self.0.pool)
            .await?);
        };
        Ok(sqlx::query_as!(
            JobSummary,
            r#"SELECT j.id AS "id: JobId", j.owner_id, j.idempotency_key, j.request_fingerprint,
                      j.operation, j.provider, j.status AS "status: JobStatus", j.version,
                      j.completed_by AS "completed_by: AttemptId", j.error,
                      (SELECT count(*) FROM attempts a WHERE a.job_id = j.id) AS "attempt_count!",
                      j.created_at, j.updated_at
               FROM jobs j
               WHERE EXISTS (SELECT 1 FROM attempts a
                             WHERE a.job_id = j.id AND a.provider = $7
                               AND ($5::uuid IS NULL OR a.job_id < $5))
                 AND ($1::text[] IS NULL OR j.status = ANY($1))
                 AND ($2::text IS NULL OR j.owner_id = $2)
                 AND ($3::float8 IS NULL OR j.created_at < now() - make_interval(secs => $3))
                 AND ($4::float8 IS NULL OR j.created_at >= now() - make_interval(secs => $4))
                 AND ($5::uuid IS NULL OR j.id < $5)
               ORDER BY j.id DESC
               LIMIT $6"#,
            statuses.as_deref(),
            owner,
            older,
            newer,
            after,
            limit,
            provider
        )
        .fetch_all(&self.0.pool)
        .await?)
    }
}
