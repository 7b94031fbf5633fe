//! Timeouts: a still-`started` attempt (or one whose claim the database lost)
//! becomes `unknown` and blocks its job, or is discarded when its job has
//! ended meanwhile.

use std::collections::{BTreeSet, HashMap};

use sqlx::PgConnection;
use uuid::Uuid;

use crate::domain::{AttemptId, AttemptStatus, JobStatus};
use crate::edges::store::error::{Result, corrupt};
use crate::edges::store::settle::Settled;
use crate::settings::config::EvidenceKind;

/// An attempt whose outcome is not known by its deadline.
pub(in crate::edges::store) struct Timeout {
    /// The attempt.
    pub attempt_id: AttemptId,
    /// Why its outcome is not known.
    pub error: String,
    /// The evidence its call asked for, where the settler made the call.
    pub asked: Option<EvidenceKind>,
}

/// Timeouts: each still-`started` attempt becomes `unknown` and blocks its job,
/// unless the job has already ended (another attempt won, or it was cancelled):
/// then nothing is blocked any more, and the attempt is `discarded` with the
/// reason, and evidence looks for what its call cost (it may have run, and
/// been paid for). An attempt found `queued` was called under a claim the
/// database has since lost (a failover without synchronous replication): its
/// call may have run all the same, so it is settled as if the claim had
/// stayed, and said and counted; only when `called` (the timeouts of calls
/// made, not a sweep's guesses, which a claim handed back may have
/// overtaken). Its record of the evidence the call asked for was lost with
/// the claim: the timeout's own ([`Timeout::asked`]) is recorded instead.
/// Attempts are locked first, then their jobs, as everywhere.
pub(in crate::edges::store) async fn mark_unknown(
    tx: &mut PgConnection,
    unknowns: &[Timeout],
    called: bool,
) -> Result<HashMap<AttemptId, Settled>> {
    let ids: Vec<Uuid> = unknowns.iter().map(|u| u.attempt_id.0).collect();
    let rows = sqlx::query!(
        r#"SELECT id, job_id, provider, status = 'queued' AS "claim_lost!" FROM attempts
           WHERE id = ANY($1) AND (status = 'started' OR (status = 'queued' AND $2))
           ORDER BY id FOR UPDATE"#,
        &ids,
        called
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut locked = Vec::with_capacity(rows.len());
    let mut lost = BTreeSet::new();
    for row in rows {
        if row.claim_lost {
            claim_lost(row.job_id, row.id, &row.provider);
            lost.insert(row.id);
        }
        locked.push((row.id, row.job_id));
    }
    if locked.is_empty() {
        return Ok(HashMap::new());
    }
    let job_ids: Vec<Uuid> = locked
        .iter()
        .map(|l| l.1)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    // Locked, then read by a new statement: a job that ended meanwhile is seen ended.
    let jobs: HashMap<Uuid, (JobStatus, Option<AttemptId>)> = sqlx::query!(
        r#"SELECT id, status AS "status: JobStatus", completed_by AS "completed_by: AttemptId"
           FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE"#,
        &job_ids
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.id, (r.status, r.completed_by)))
    .collect();
    let timeouts: HashMap<AttemptId, &Timeout> =
        unknowns.iter().map(|t| (t.attempt_id, t)).collect();
    let mut outcomes = HashMap::new();
    let mut marks = Marks::default();
    for (attempt, job) in &locked {
        let timeout = timeouts.get(&AttemptId(*attempt));
        let error = timeout.map_or("", |t| t.error.as_str());
        let (status, winner) = jobs
            .get(job)
            .ok_or_else(|| corrupt(format!("attempt {attempt} has no job {job}")))?;
        let asked = timeout
            .and_then(|t| t.asked)
            .filter(|_| lost.contains(attempt));
        let (settled, text) = if status.is_terminal() {
            let text = format!("discarded: {error} (after its job had ended)");
            (Settled::Discarded { winner: *winner }, text)
        } else {
            (Settled::Unknown, error.to_owned())
        };
        marks.ids.push(*attempt);
        marks.statuses.push(match settled {
            Settled::Unknown => AttemptStatus::Unknown,
            _ => AttemptStatus::Discarded,
        });
        marks.texts.push(text);
        marks.asked.push(asked.map(|kind| kind.as_str().to_owned()));
        outcomes.insert(AttemptId(*attempt), settled);
    }
    write(tx, &marks).await?;
    Ok(outcomes)
}

/// What [`write`] writes, an array a column.
#[derive(Default)]
struct Marks {
    ids: Vec<Uuid>,
    statuses: Vec<AttemptStatus>,
    texts: Vec<String>,
    /// The evidence a call under a lost claim asked for; `None` elsewhere.
    asked: Vec<Option<String>>,
}

/// Says and counts a timeout whose attempt was found `queued`.
fn claim_lost(job: Uuid, attempt: Uuid, provider: &str) {
    tracing::error!(
        job_id = %job,
        attempt_id = %attempt,
        "the database lost this attempt's committed claim (a failover without synchronous replication?): its call timed out, and may have run, so it is settled as unknown as if the claim had stayed"
    );
    crate::edges::metrics::claim_lost(provider);
}

/// Writes each attempt's status and error (and, under a lost claim, the
/// evidence its call asked for), and blocks the jobs of those `unknown` (a
/// job still `queued` had its claim lost with the attempt's).
async fn write(tx: &mut PgConnection, marks: &Marks) -> Result<()> {
    sqlx::query!(
        "WITH marked AS (
             UPDATE attempts a
             SET status = i.status, error = i.error,
                 started_at = COALESCE(a.started_at, now()),
                 finished_at = CASE WHEN i.status = 'discarded' THEN now() END,
                 evidence_next_at = CASE WHEN i.status = 'discarded' THEN now() END,
                 evidence = COALESCE(a.evidence, i.asked)
             FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[])
                  AS i(attempt_id, status, error, asked)
             WHERE a.id = i.attempt_id
             RETURNING a.job_id, a.status
         )
         UPDATE jobs j SET status = 'unknown', updated_at = now()
         FROM (SELECT DISTINCT job_id FROM marked WHERE status = 'unknown') m
         WHERE j.id = m.job_id AND j.status IN ('running', 'queued')",
        &marks.ids,
        &marks.statuses as &[AttemptStatus],
        &marks.texts,
        &marks.asked as &[Option<String>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}
