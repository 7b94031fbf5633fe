//! Definite failures written: the attempts marked `failed`, their jobs locked
//! and read, and the plan carried out (next attempts, blocks lifted, jobs
//! failed).

use crate::edges::store::handles::Settle;
use crate::policy::next::{FailedJob, NextStep};
use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use crate::edges::store::drafts::{Ended, OutboxDraft};
use crate::edges::store::error::{Result, corrupt};
use crate::edges::store::next_turns::NextTurn;
use crate::edges::store::settle::{Failure, Settled};
use crate::policy::batch::{
    AttemptCounts, Definite, FailedAttempt, FailurePlan, JobState, NextAttempt, plan_failures,
};

impl Settle<'_> {
    /// Definite failures: mark the attempts `failed`, then, per job, either create
    /// the next attempt (with its not-before time persisted) or fail the job.
    /// `called`: these are failures calls reported, so an attempt found
    /// `queued` was called under a claim the database lost.
    pub(super) async fn settle_failures(
        self,
        tx: &mut PgConnection,
        failures: &[Failure],
        from: &[AttemptStatus],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
        immediate: bool,
        called: bool,
    ) -> Result<(Vec<(AttemptId, Settled)>, Vec<OutboxDraft>)> {
        let failed = mark_failed(tx, failures, from, called).await?;
        if failed.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let job_ids: Vec<Uuid> = failed
            .iter()
            .map(|f| f.job_id)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let states = lock_jobs(tx, &job_ids).await?;
        let definite: Vec<Definite> = failures
            .iter()
            .map(|f| Definite {
                attempt_id: f.attempt_id,
                retryable: f.retryable,
                retry_after: f.retry_after,
            })
            .collect();
        let planned = plan_failures(&failed, &states, &definite, plan, immediate, Utc::now())
            .map_err(|e| corrupt(e.to_string()))?;
        let triggered = planned.triggered.clone();
        let (drafts, failed_jobs) = self.apply_failure_plan(tx, planned).await?;
        let outcomes = failed
            .iter()
            .map(|f| {
                (
                    AttemptId(f.attempt_id),
                    Settled::Failed {
                        next: triggered.get(&f.attempt_id).copied(),
                        job_failed: failed_jobs.contains(&f.job_id),
                    },
                )
            })
            .collect();
        Ok((outcomes, drafts))
    }

    /// Writes a failure plan: jobs unblocked (their waiting attempts published
    /// again), next attempts created (each with its turn held), jobs failed. Returns the outbox rows to
    /// write and the jobs that failed.
    async fn apply_failure_plan(
        self,
        tx: &mut PgConnection,
        plan: FailurePlan,
    ) -> Result<(Vec<OutboxDraft>, BTreeSet<Uuid>)> {
        let FailurePlan {
            next_attempts,
            give_up,
            unblocked,
            republish,
            ..
        } = plan;
        let mut drafts: Vec<OutboxDraft> = republish
            .iter()
            .map(|(attempt, job, provider)| {
                self.0
                    .routes
                    .attempt_draft(AttemptId(*attempt), JobId(*job), provider, None)
            })
            .collect();
        if !unblocked.is_empty() {
            sqlx::query!(
                "UPDATE jobs SET status = 'running', updated_at = now()
                 WHERE id = ANY($1) AND status = 'unknown'",
                &unblocked
            )
            .execute(&mut *tx)
            .await?;
        }
        insert_next_attempts(tx, &next_attempts).await?;
        // A retry takes its turn as a first attempt does: held, for the
        // provider's hand-out.
        let turns: Vec<NextTurn<'_>> = next_attempts
            .iter()
            .map(|n| NextTurn {
                attempt: n.id,
                job: n.job,
                provider: &n.provider,
                due: n.not_before,
            })
            .collect();
        self.0.hold_turns(tx, &turns).await?;
        let mut failed_jobs = BTreeSet::new();
        if !give_up.is_empty() {
            let jobs: Vec<Uuid> = give_up.iter().map(|g| g.0).collect();
            let errors: Vec<String> = give_up.iter().map(|g| g.1.clone()).collect();
            let ended = sqlx::query_as!(
                Ended,
                r#"UPDATE jobs j
                   SET status = 'failed', error = g.error, version = j.version + 1, updated_at = now()
                   FROM unnest($1::uuid[], $2::text[]) AS g(job_id, error)
                   WHERE j.id = g.job_id AND j.status IN ('queued', 'running', 'unknown')
                   RETURNING j.id AS "job_id: JobId", j.version, j.owner_id, j.idempotency_key,
                             j.operation, j.status AS "status: JobStatus",
                             j.completed_by AS "completed_by: AttemptId", j.result, j.error"#,
                &jobs,
                &errors,
            )
            .fetch_all(&mut *tx)
            .await?;
            for ended in ended {
                failed_jobs.insert(ended.job_id.0);
                drafts.push(ended.draft(&self.0.routes));
            }
        }
        Ok((drafts, failed_jobs))
    }
}

/// Creates the planned attempts; a job that was `unknown` runs again.
async fn insert_next_attempts(tx: &mut PgConnection, next_attempts: &[NextAttempt]) -> Result<()> {
    if next_attempts.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = next_attempts.iter().map(|n| n.id.0).collect();
    let jobs: Vec<Uuid> = next_attempts.iter().map(|n| n.job.0).collect();
    let numbers: Vec<i32> = next_attempts.iter().map(|n| n.number).collect();
    let providers: Vec<String> = next_attempts.iter().map(|n| n.provider.clone()).collect();
    let not_before: Vec<Option<DateTime<Utc>>> =
        next_attempts.iter().map(|n| n.not_before).collect();
    sqlx::query!(
        "WITH new AS (
             INSERT INTO attempts (id, job_id, number, provider, not_before)
             SELECT n.id, n.job_id, n.number, n.provider, COALESCE(n.not_before, now())
             FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[], $5::timestamptz[])
                  AS n(id, job_id, number, provider, not_before)
             RETURNING job_id
         )
         UPDATE jobs j SET status = 'running', updated_at = now()
         FROM new WHERE j.id = new.job_id AND j.status = 'unknown'",
        &ids,
        &jobs,
        &numbers,
        &providers,
        &not_before as &[Option<DateTime<Utc>>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Marks the attempts `failed` where their status is one of `from`; returns
/// those it changed. When `called`, one found `queued` is said and counted as
/// a claim lost.
async fn mark_failed(
    tx: &mut PgConnection,
    failures: &[Failure],
    from: &[AttemptStatus],
    called: bool,
) -> Result<Vec<FailedAttempt>> {
    let ids: Vec<Uuid> = failures.iter().map(|f| f.attempt_id.0).collect();
    let errors: Vec<String> = failures.iter().map(|f| f.error.clone()).collect();
    let usages: Vec<Option<Value>> = failures.iter().map(|f| f.usage.clone()).collect();
    let request_ids: Vec<Option<String>> = failures.iter().map(|f| f.request_id.clone()).collect();
    let rows = sqlx::query!(
        r#"WITH prior AS (SELECT id, status FROM attempts WHERE id = ANY($1))
           UPDATE attempts a
             SET status = 'failed', error = i.error, finished_at = now(),
                 started_at = COALESCE(a.started_at, now()),
                 usage = COALESCE(i.usage, a.usage),
                 provider_request_id = COALESCE(i.request_id, a.provider_request_id)
             FROM unnest($1::uuid[], $2::text[], $3::jsonb[], $4::text[])
                  AS i(attempt_id, error, usage, request_id), prior p
             WHERE a.id = i.attempt_id AND p.id = a.id AND a.status = ANY($5)
             RETURNING a.id AS attempt_id, a.job_id, a.provider, a.error AS "error!",
                       p.status = 'queued' AS "was_queued!""#,
        &ids,
        &errors,
        &usages as &[Option<Value>],
        &request_ids as &[Option<String>],
        from as &[AttemptStatus],
    )
    .fetch_all(&mut *tx)
    .await?;
    // A call's failure that finds its attempt `queued` was made under a
    // claim the database has since lost (a failover without synchronous
    // replication): settled as if the claim had stayed, and said.
    for lost in rows.iter().filter(|r| called && r.was_queued) {
        tracing::error!(
            job_id = %lost.job_id,
            attempt_id = %lost.attempt_id,
            "the database lost this attempt's committed claim (a failover without synchronous replication?): its call failed, and the failure is settled as if the claim had stayed"
        );
        crate::edges::metrics::claim_lost(&lost.provider);
    }
    Ok(rows
        .into_iter()
        .map(|r| FailedAttempt {
            attempt_id: r.attempt_id,
            job_id: r.job_id,
            provider: r.provider,
            error: r.error,
        })
        .collect())
}

/// Locks the jobs (in id order), then reads their attempts in a new statement:
/// its fresh snapshot sees any attempt another transaction committed while this
/// one waited for the lock.
async fn lock_jobs(tx: &mut PgConnection, job_ids: &[Uuid]) -> Result<HashMap<Uuid, JobState>> {
    let jobs: HashMap<Uuid, (JobStatus, String)> = sqlx::query!(
        r#"SELECT id, status AS "status: JobStatus", operation
           FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE"#,
        job_ids
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.id, (r.status, r.operation)))
    .collect();
    let mut counts: HashMap<Uuid, AttemptCounts> = sqlx::query_as!(
        AttemptCounts,
        r#"SELECT a.job_id, count(*) AS "made!", max(a.number) AS "max_number!",
                  bool_or(a.status IN ('queued', 'started', 'unknown')) AS "open!",
                  bool_or(a.status = 'unknown') AS "unknown!",
                  COALESCE(array_agg(a.id) FILTER (WHERE a.status = 'queued' AND h.attempt_id IS NULL), '{}')
                      AS "queued!",
                  COALESCE(array_agg(a.provider) FILTER (WHERE a.status = 'queued' AND h.attempt_id IS NULL), '{}')
                      AS "queued_providers!"
           FROM attempts a
           LEFT JOIN turns h ON h.attempt_id = a.id AND h.handed_out_at IS NULL
           WHERE a.job_id = ANY($1) GROUP BY a.job_id"#,
        job_ids
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|c| (c.job_id, c))
    .collect();
    let mut states = HashMap::new();
    for (id, (status, operation)) in jobs {
        let counts = counts
            .remove(&id)
            .ok_or_else(|| corrupt(format!("job {id} has no attempts")))?;
        states.insert(
            id,
            JobState {
                status,
                operation,
                counts,
            },
        );
    }
    Ok(states)
}
