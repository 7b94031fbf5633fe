//! Successes: the compare-and-swap, in which exactly one attempt per job wins
//! and every other is discarded, its usage kept.

use crate::edges::store::handles::Settle;
use std::collections::HashMap;

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::domain::{AttemptId, JobId, JobStatus};
use crate::edges::store::drafts::{Ended, OutboxDraft, Routes};
use crate::edges::store::error::{Result, corrupt};
use crate::edges::store::settle::{Finished, Settled, Verdict};

impl Settle<'_> {
    /// The compare-and-swap. Exactly one attempt per job can move `completed_by`
    /// from NULL; every other open attempt that finishes is `discarded`, its usage
    /// kept, its result dropped whole. Every attempt's outcome is in
    /// `outcomes` (the discarded ones with their winner); the caller closes the
    /// `won` jobs' other attempts in a later statement
    /// ([`Outbox::insert_outbox_closing`](crate::edges::store::Outbox::insert_outbox_closing)).
    pub(super) async fn settle_successes(
        self,
        tx: &mut PgConnection,
        wins: &[&Finished],
    ) -> Result<CasOutcomes> {
        let mut out = cas_outcomes(compare_and_swap(tx, wins).await?, &self.0.routes)?;
        for (attempt, job, provider) in &out.claims_lost {
            tracing::error!(
                job_id = %job,
                attempt_id = %attempt,
                "the database lost this attempt's committed claim (a failover without synchronous replication?): its call was made, and its answer is settled as if the claim had stayed"
            );
            crate::edges::metrics::claim_lost(provider);
        }
        let discarded = std::mem::take(&mut out.discarded);
        let winners = winners_of(tx, &discarded).await?;
        for (attempt, job) in discarded {
            let winner = winners.get(&job).copied().flatten();
            tracing::info!(
                job_id = %job,
                discarded_attempt = %attempt,
                winning_attempt = ?winner.map(|w| w.to_string()),
                "late result discarded: the job already has its outcome"
            );
            out.outcomes.push((attempt, Settled::Discarded { winner }));
        }
        Ok(out)
    }
}

/// A row of [`compare_and_swap()`]: a won job, or a discarded attempt.
struct CasRow {
    job_id: Option<JobId>,
    version: Option<i64>,
    owner_id: Option<String>,
    idempotency_key: Option<String>,
    operation: Option<String>,
    status: Option<JobStatus>,
    completed_by: Option<AttemptId>,
    result: Option<Value>,
    error: Option<String>,
    discarded_job: Option<Uuid>,
    provider: Option<String>,
    claim_lost: Option<bool>,
}

/// The compare-and-swap itself, one statement for the whole batch: lock the
/// open attempts, move each job's `completed_by` from NULL where its version
/// still matches, settle every attempt as `succeeded` or `discarded`, and keep
/// the usage of attempts that had already ended. One statement, so that all of
/// it works from one snapshot.
async fn compare_and_swap(tx: &mut PgConnection, wins: &[&Finished]) -> Result<Vec<CasRow>> {
    let attempt_ids: Vec<Uuid> = wins.iter().map(|f| f.attempt_id.0).collect();
    let job_ids: Vec<Uuid> = wins.iter().map(|f| f.job_id.0).collect();
    let versions: Vec<i64> = wins.iter().map(|f| f.version).collect();
    let results: Vec<Value> = wins
        .iter()
        .map(|f| match &f.verdict {
            Verdict::Succeeded(v) => v.clone(),
            _ => Value::Null,
        })
        .collect();
    let usages: Vec<Option<Value>> = wins.iter().map(|f| f.usage.clone()).collect();
    let request_ids: Vec<Option<String>> =
        wins.iter().map(|f| f.provider_request_id.clone()).collect();
    Ok(sqlx::query_as!(
        CasRow,
        r#"WITH input AS (
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::bigint[], $4::jsonb[], $5::jsonb[], $6::text[])
                 AS t(attempt_id, job_id, version, result, usage, request_id)
         ), open AS (
             -- An attempt found `queued` had its claim committed, as the
             -- worker saw, and lost since (a failover without synchronous
             -- replication): its call was made, and its answer is kept.
             SELECT a.id, a.provider, (a.status = 'queued') AS claim_lost
             FROM attempts a JOIN input i ON a.id = i.attempt_id AND a.job_id = i.job_id
             WHERE (a.status IN ('started', 'unknown', 'queued')) IS TRUE
             ORDER BY a.id
             FOR UPDATE OF a
         ), won AS (
             UPDATE jobs j
             SET status = 'succeeded', result = i.result, completed_by = i.attempt_id,
                 version = j.version + 1, error = NULL, updated_at = now()
             FROM input i JOIN open o ON o.id = i.attempt_id
             WHERE j.id = i.job_id AND j.version = i.version AND j.completed_by IS NULL
               AND j.status IN ('queued', 'running', 'unknown')
             RETURNING j.id, j.version, j.owner_id, j.idempotency_key, j.operation, j.status,
                       j.completed_by, j.result, j.error
         ), settled AS (
             UPDATE attempts a
             SET status = CASE WHEN w.id IS NOT NULL THEN 'succeeded' ELSE 'discarded' END,
                 error = CASE WHEN w.id IS NULL
                              THEN 'discarded: another attempt had already won, or the job had ended' END,
                 started_at = COALESCE(a.started_at, now()),
                 finished_at = now(), usage = i.usage, provider_request_id = i.request_id
             FROM input i JOIN open o ON o.id = i.attempt_id
                  LEFT JOIN won w ON w.completed_by = i.attempt_id
             WHERE a.id = i.attempt_id
             RETURNING a.id, a.status
         ), late AS (
             UPDATE attempts a
             SET usage = COALESCE(a.usage, i.usage),
                 provider_request_id = COALESCE(a.provider_request_id, i.request_id)
             FROM input i
             WHERE a.id = i.attempt_id AND a.id NOT IN (SELECT id FROM open)
             RETURNING a.id
         )
         SELECT w.id AS "job_id: JobId", w.version, w.owner_id, w.idempotency_key,
                w.operation, w.status AS "status: JobStatus",
                w.completed_by AS "completed_by: AttemptId", w.result, w.error,
                NULL::uuid AS discarded_job, o.provider, o.claim_lost
         FROM won w JOIN open o ON o.id = w.completed_by
         UNION ALL
         SELECT NULL, NULL, NULL, NULL, NULL, NULL, s.id, NULL, NULL, i.job_id,
                o.provider, o.claim_lost
         FROM settled s JOIN input i ON i.attempt_id = s.id JOIN open o ON o.id = s.id
         WHERE s.status = 'discarded'"#,
        &attempt_ids,
        &job_ids,
        &versions,
        &results,
        &usages as &[Option<Value>],
        &request_ids as &[Option<String>],
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// What the compare-and-swap's rows say, read without I/O.
#[derive(Debug, Default)]
pub(super) struct CasOutcomes {
    /// `Won` for each winning attempt.
    pub(super) outcomes: Vec<(AttemptId, Settled)>,
    /// The `job.succeeded` event of each won job.
    pub(super) events: Vec<OutboxDraft>,
    /// `(job, winner)` of each won job.
    pub(super) won: Vec<(Uuid, Uuid)>,
    /// `(attempt, job)` of each discarded attempt.
    discarded: Vec<(AttemptId, Uuid)>,
    /// `(attempt, job, provider)` of each attempt found `queued`: the
    /// database lost the claim its call was made under.
    claims_lost: Vec<(AttemptId, Uuid, String)>,
}

/// Reads the compare-and-swap's rows: each is a won job (its event's columns)
/// or a discarded attempt (`completed_by` then carries the attempt,
/// `discarded_job` its job).
fn cas_outcomes(rows: Vec<CasRow>, routes: &Routes) -> Result<CasOutcomes> {
    let mut out = CasOutcomes::default();
    for row in rows {
        let (Some(attempt), discarded_job) = (row.completed_by, row.discarded_job) else {
            return Err(corrupt("settled row without an attempt"));
        };
        if row.claim_lost == Some(true) {
            let job = discarded_job
                .or(row.job_id.map(|j| j.0))
                .ok_or_else(|| corrupt("settled row without its job"))?;
            let provider = row.provider.clone().unwrap_or_default();
            out.claims_lost.push((attempt, job, provider));
        }
        if let Some(job) = discarded_job {
            out.discarded.push((attempt, job));
            continue;
        }
        let ended = Ended {
            job_id: row
                .job_id
                .ok_or_else(|| corrupt("won row without its job"))?,
            version: row.version.unwrap_or_default(),
            owner_id: row.owner_id.unwrap_or_default(),
            idempotency_key: row.idempotency_key.unwrap_or_default(),
            operation: row.operation.unwrap_or_default(),
            status: row.status.unwrap_or(JobStatus::Succeeded),
            completed_by: Some(attempt),
            result: row.result,
            error: row.error,
        };
        out.won.push((ended.job_id.0, attempt.0));
        out.events.push(ended.draft(routes));
        out.outcomes.push((attempt, Settled::Won));
    }
    Ok(out)
}

/// The winners of the jobs whose compare-and-swap failed, read by a statement
/// of its own: its fresh snapshot sees the winner that made it fail.
async fn winners_of(
    tx: &mut PgConnection,
    discarded: &[(AttemptId, Uuid)],
) -> Result<HashMap<Uuid, Option<AttemptId>>> {
    if discarded.is_empty() {
        return Ok(HashMap::new());
    }
    let jobs: Vec<Uuid> = discarded.iter().map(|(_, j)| *j).collect();
    Ok(sqlx::query!(
        r#"SELECT id, completed_by AS "completed_by: AttemptId" FROM jobs WHERE id = ANY($1)"#,
        &jobs
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.id, r.completed_by))
    .collect())
}

#[cfg(test)]
mod tests {
    use super::{CasRow, cas_outcomes};
    use crate::domain::{AttemptId, JobId, JobStatus};
    use crate::edges::store::drafts::test_routes as routes;
    use crate::edges::store::error::StoreError;
    use crate::edges::store::settle::Settled;
    use uuid::Uuid;

    fn won_row(job: Uuid, attempt: Uuid, version: i64) -> CasRow {
        CasRow {
            job_id: Some(JobId(job)),
            version: Some(version),
            owner_id: Some("acct".into()),
            idempotency_key: Some("k".into()),
            operation: Some("op".into()),
            status: Some(JobStatus::Succeeded),
            completed_by: Some(AttemptId(attempt)),
            result: Some(serde_json::json!({"summary": "s"})),
            error: None,
            discarded_job: None,
            provider: Some("primary".into()),
            claim_lost: Some(false),
        }
    }

    #[test]
    fn a_won_row_wins_and_writes_its_event_a_discarded_row_only_waits_for_its_winner() {
        let (job, winner, late, other_job) = (
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
        );
        let discarded = CasRow {
            job_id: None,
            version: None,
            owner_id: None,
            idempotency_key: None,
            operation: None,
            status: None,
            completed_by: Some(AttemptId(late)),
            result: None,
            error: None,
            discarded_job: Some(other_job),
            provider: Some("primary".into()),
            claim_lost: Some(false),
        };
        let out = cas_outcomes(vec![won_row(job, winner, 3), discarded], &routes()).unwrap();
        assert_eq!(out.outcomes, vec![(AttemptId(winner), Settled::Won)]);
        assert_eq!(out.won, vec![(job, winner)]);
        assert_eq!(out.discarded, vec![(AttemptId(late), other_job)]);
        assert!(out.claims_lost.is_empty());
        let event = &out.events[0];
        assert_eq!(
            (event.exchange.as_str(), event.routing_key.as_str()),
            ("onejob.events", "job.succeeded")
        );
        // The event id is job:version, so a re-published event deduplicates.
        assert_eq!(event.message_id, format!("{job}:3"));
        assert_eq!(event.body["status"], "succeeded");
        assert_eq!(event.body["completed_by"], winner.to_string());
        assert_eq!(event.body["result"]["summary"], "s");
    }

    #[test]
    fn a_row_whose_claim_was_lost_is_listed_with_its_provider_won_or_discarded() {
        let (job, attempt) = (Uuid::now_v7(), Uuid::now_v7());
        let mut won = won_row(job, attempt, 1);
        won.claim_lost = Some(true);
        let (other_job, late) = (Uuid::now_v7(), Uuid::now_v7());
        let mut discarded = won_row(other_job, late, 1);
        discarded.job_id = None;
        discarded.discarded_job = Some(other_job);
        discarded.claim_lost = Some(true);
        let out = cas_outcomes(vec![won, discarded], &routes()).unwrap();
        assert_eq!(out.outcomes, vec![(AttemptId(attempt), Settled::Won)]);
        assert_eq!(
            out.claims_lost,
            vec![
                (AttemptId(attempt), job, "primary".to_owned()),
                (AttemptId(late), other_job, "primary".to_owned())
            ]
        );
    }

    #[test]
    fn a_row_without_its_attempt_is_corrupt_not_a_guess() {
        let mut row = won_row(Uuid::now_v7(), Uuid::now_v7(), 1);
        row.completed_by = None;
        assert!(matches!(
            cas_outcomes(vec![row], &routes()),
            Err(StoreError::Corrupt(_))
        ));
        let mut row = won_row(Uuid::now_v7(), Uuid::now_v7(), 1);
        row.job_id = None;
        assert!(cas_outcomes(vec![row], &routes()).is_err());
    }
}
