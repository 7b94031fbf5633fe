//! Kept answers: a provider's answer that could not be settled yet, because
//! its job row was held under someone else's lock, is written onto its attempt
//! before anything could hand its delivery back; so is an answer evidence
//! found, before it is settled. A worker that stops meanwhile then loses
//! nothing: the reconciler settles kept answers, and the vanished-worker
//! sweep never makes an attempt with one `unknown`. A kept answer ends in the
//! transaction that settles it: cleared by the settlement
//! ([`super::settle::take_rows`] finds it), or by the trigger
//! `attempts_answer_closed` when its attempt closes by any other path, its
//! usage kept on the attempt.

use crate::edges::store::handles::Kept;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::domain::{AttemptId, JobId};
use crate::edges::store::error::{Result, corrupt};
use crate::edges::store::settle::{Finished, Verdict};

/// An answer as kept on its attempt (`attempts.answer`).
#[derive(Debug, Serialize, serde::Deserialize)]
struct KeptAnswer {
    /// The job's version when the attempt started: the compare-and-swap's guard.
    version: i64,
    verdict: Verdict,
    usage: Option<Value>,
    request_id: Option<String>,
}

/// What became of a settlement handed on through the broker
/// ([`Kept::keep_handed_on`](crate::edges::store::Kept::keep_handed_on)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandedOn {
    /// Kept on its attempt, for the kept-answer pass to settle.
    Kept,
    /// Its attempt's row is held under someone else's lock: nothing written.
    Held,
    /// Its attempt, under the same claim, is no longer open: it was settled
    /// already (a duplicate, or evidence or an operator got there first).
    Settled,
    /// No attempt of that job was started under that claim: nothing kept.
    NoSuchClaim,
}

/// An answer as its attempt keeps it.
fn kept_answer(finished: &Finished) -> Result<Value> {
    serde_json::to_value(KeptAnswer {
        version: finished.version,
        verdict: finished.verdict.clone(),
        usage: finished.usage.clone(),
        request_id: finished.provider_request_id.clone(),
    })
    .map_err(corrupt)
}

impl Kept<'_> {
    /// Keeps a settlement handed on through the broker on its attempt, if
    /// that attempt is still open and was started under `claim` (the secret
    /// only its worker knew): never waits for a held row (`SKIP LOCKED`).
    /// An attempt under that claim that was settled meanwhile keeps what the
    /// call cost (its usage and request id, where it has none), as a late
    /// answer's settlement would. Whatever else it names keeps nothing.
    pub async fn keep_handed_on(self, finished: &Finished, claim: Uuid) -> Result<HandedOn> {
        let kept = kept_answer(finished)?;
        self.0.retrying(|| async {
            let row = sqlx::query!(
                r#"WITH target AS (
                       SELECT status IN ('started', 'unknown') AS open, claim = $3 AS ours
                       FROM attempts WHERE id = $1 AND job_id = $4
                   ), kept AS (
                       UPDATE attempts SET answer = $2, kept_next_at = NULL
                       WHERE id IN (SELECT id FROM attempts
                                    WHERE id = $1 AND job_id = $4 AND claim = $3
                                      AND status IN ('started', 'unknown')
                                    FOR UPDATE SKIP LOCKED)
                       RETURNING id
                   ), late AS (
                       UPDATE attempts
                       SET usage = coalesce(usage, $5), provider_request_id = coalesce(provider_request_id, $6)
                       WHERE id = $1 AND job_id = $4 AND claim = $3
                         AND status NOT IN ('queued', 'started', 'unknown')
                       RETURNING id
                   )
                   SELECT (SELECT count(*) FROM kept) AS "kept!",
                          (SELECT open FROM target) AS open,
                          (SELECT ours FROM target) AS ours"#,
                finished.attempt_id.0,
                &kept,
                claim,
                finished.job_id.0,
                finished.usage.as_ref(),
                finished.provider_request_id.as_deref(),
            )
            .fetch_one(&self.0.pool)
            .await?;
            Ok(match (row.kept, row.ours, row.open) {
                (1.., _, _) => HandedOn::Kept,
                (_, Some(true), Some(true)) => HandedOn::Held,
                (_, Some(true), _) => HandedOn::Settled,
                _ => HandedOn::NoSuchClaim,
            })
        })
        .await
    }

    /// Keeps `finished` on its attempt while the attempt is still open. Takes
    /// the attempt row with `SKIP LOCKED`, so it never waits: false when the
    /// row was held (or the attempt is no longer open) and nothing was kept.
    /// A kept answer is due for the kept-answer pass at once. `found`, for an
    /// answer a look at evidence found, is written as the look's note with
    /// it: whoever settles the answer, the attempt says what was found.
    pub async fn keep_answer(self, finished: &Finished, found: Option<&str>) -> Result<bool> {
        let kept = kept_answer(finished)?;
        self.0
            .retrying(|| async {
                let done = sqlx::query!(
                    "UPDATE attempts SET answer = $2, kept_next_at = NULL,
                        evidence_note = coalesce($3, evidence_note),
                        evidence_last_at = CASE WHEN $3::text IS NULL THEN evidence_last_at
                                                ELSE now() END
                 WHERE id IN (SELECT id FROM attempts
                              WHERE id = $1 AND status IN ('started', 'unknown')
                              FOR UPDATE SKIP LOCKED)",
                    finished.attempt_id.0,
                    &kept,
                    found,
                )
                .execute(&self.0.pool)
                .await?;
                Ok(done.rows_affected() == 1)
            })
            .await
    }

    /// Open attempts with a kept answer that is due, at most `limit`, as
    /// finished attempts to settle: never tried first, then those tried
    /// longest ago, so that answers whose rows stay held (moved on by
    /// [`Kept::later`](crate::edges::store::Kept::later)) never stand in front of newer ones. A kept
    /// answer this version cannot read is set aside for good (an operator
    /// resolves its attempt), with an error in the log.
    pub async fn answers(self, limit: i64) -> Result<Vec<Finished>> {
        let rows = sqlx::query!(
            r#"SELECT id AS "attempt_id: AttemptId", job_id AS "job_id: JobId",
                      answer AS "answer!"
               FROM attempts
               WHERE answer IS NOT NULL AND status IN ('started', 'unknown')
                 AND (kept_next_at IS NULL OR kept_next_at <= now())
               ORDER BY kept_next_at NULLS FIRST, id
               LIMIT $1"#,
            limit
        )
        .fetch_all(&self.0.pool)
        .await?;
        let mut finished = Vec::with_capacity(rows.len());
        let mut unreadable = Vec::new();
        for r in rows {
            match serde_json::from_value::<KeptAnswer>(r.answer) {
                Ok(kept) => finished.push(Finished {
                    attempt_id: r.attempt_id,
                    job_id: r.job_id,
                    version: kept.version,
                    provider_request_id: kept.request_id,
                    usage: kept.usage,
                    verdict: kept.verdict,
                    // Kept only on the attempt that holds its claim.
                    asked: None,
                }),
                Err(e) => {
                    tracing::error!(attempt_id = %r.attempt_id, error = %e, "a kept answer cannot be read; the attempt waits for an operator");
                    unreadable.push(r.attempt_id.0);
                }
            }
        }
        if !unreadable.is_empty() {
            // A row held elsewhere is marked by a later pass.
            sqlx::query!(
                "UPDATE attempts SET kept_next_at = 'infinity'
                 WHERE id IN (SELECT id FROM attempts WHERE id = ANY($1)
                              FOR UPDATE SKIP LOCKED)",
                &unreadable
            )
            .execute(&self.0.pool)
            .await?;
        }
        Ok(finished)
    }

    /// Moves the kept answers of `attempts` (whose rows were held when the
    /// pass tried them) behind the others, due again in `pause`. An attempt
    /// whose own row is still held is left as it is, due at once: waiting
    /// for its lock would hold the pass up for as long as the holder likes.
    pub async fn later(self, attempts: &[AttemptId], pause: Duration) -> Result<()> {
        if attempts.is_empty() {
            return Ok(());
        }
        let ids: Vec<Uuid> = attempts.iter().map(|a| a.0).collect();
        sqlx::query!(
            "UPDATE attempts SET kept_next_at = now() + make_interval(secs => $2)
             WHERE id IN (SELECT id FROM attempts WHERE id = ANY($1) FOR UPDATE SKIP LOCKED)
               AND answer IS NOT NULL AND kept_next_at IS DISTINCT FROM 'infinity'",
            &ids,
            pause.as_secs_f64(),
        )
        .execute(&self.0.pool)
        .await?;
        Ok(())
    }

    /// The answers kept on open attempts, by why they wait: `due` (the pass
    /// settles them next), `held` (their rows were held when last tried) and
    /// `unreadable` (an operator resolves them).
    pub async fn waiting(self) -> Result<KeptWaiting> {
        let row = sqlx::query!(
            r#"SELECT count(*) FILTER (WHERE kept_next_at IS NULL OR kept_next_at <= now()) AS "due!",
                      count(*) FILTER (WHERE kept_next_at > now() AND kept_next_at < 'infinity') AS "held!",
                      count(*) FILTER (WHERE kept_next_at = 'infinity') AS "unreadable!"
               FROM attempts
               WHERE answer IS NOT NULL AND status IN ('started', 'unknown')"#
        )
        .fetch_one(&self.0.pool)
        .await?;
        Ok(KeptWaiting {
            due: row.due,
            held: row.held,
            unreadable: row.unreadable,
        })
    }
}

/// The answers kept on open attempts, by why they wait
/// ([`Kept::waiting`](crate::edges::store::Kept::waiting)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KeptWaiting {
    /// Due: the kept-answer pass settles them next.
    pub due: i64,
    /// Their rows were held under someone else's lock when last tried.
    pub held: i64,
    /// This version cannot read them: an operator resolves their attempts.
    pub unreadable: i64,
}
