//! Evidence lookups: the `unknown` attempts of providers that keep evidence,
//! taken one pod at a time under a lease, and what each look found.

use crate::edges::store::handles::Evidence;
use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::domain::{AttemptId, JobId};
use crate::edges::store::error::Result;

/// An unknown attempt due for a look at its provider's evidence.
#[derive(Clone, Debug)]
pub struct EvidenceDue {
    /// The attempt.
    pub attempt_id: AttemptId,
    /// Its job.
    pub job_id: JobId,
    /// Its provider.
    pub provider: String,
    /// Its job's operation.
    pub operation: String,
    /// Its job's version now: the compare-and-swap's guard.
    pub version: i64,
    /// Its job's input: an `idempotency_key` look sends the request again.
    pub input: Value,
    /// When its call started: the evidence deadline counts from here.
    pub started_at: DateTime<Utc>,
    /// Looks taken so far, this one included.
    pub looks: i32,
    /// It was discarded while still unknown (another attempt won): a look
    /// now only records what its call cost, if the provider kept it.
    pub discarded: bool,
    /// What evidence its own call asked for (`stored`, `idempotency_key`,
    /// `none`; `None` for a call made before onejob recorded it): evidence
    /// is concluded only from a call that asked for it.
    pub asked: Option<String>,
}

impl Evidence<'_> {
    /// Takes up to `limit` unknown attempts of `providers` (each with its
    /// `evidence_delay`) whose next look is due: the first no sooner than the
    /// delay after the call's deadline. Attempts discarded while unknown
    /// (another attempt won) are taken too while their cost is not known.
    /// Each is leased for `lease`: no other pod takes it meanwhile. Rows held
    /// by someone else are skipped, and so are attempts with an answer kept
    /// on them (found already: the kept-answer pass settles it).
    pub async fn evidence_due(
        self,
        providers: &[(String, Duration)],
        lease: Duration,
        limit: i64,
    ) -> Result<Vec<EvidenceDue>> {
        let names: Vec<String> = providers.iter().map(|p| p.0.clone()).collect();
        let delays: Vec<f64> = providers.iter().map(|p| p.1.as_secs_f64()).collect();
        // One token for every try: a try whose commit took effect although
        // its reply was lost is found again by the next, which would
        // otherwise see the attempt leased (by itself) and leave it unlooked
        // at for a whole lease.
        let token = Uuid::now_v7();
        self.0
            .retrying(|| async {
                Ok(sqlx::query_as!(
                    EvidenceDue,
                    r#"WITH p AS (
                     SELECT * FROM unnest($1::text[], $2::float8[]) AS p(name, delay)
                   ), due AS (
                     SELECT a.id FROM attempts a JOIN p ON p.name = a.provider
                     WHERE (a.status = 'unknown'
                            OR (a.status = 'discarded' AND a.usage IS NULL
                                AND a.evidence_next_at IS NOT NULL))
                       AND a.answer IS NULL
                       AND (COALESCE(a.evidence_next_at,
                                     COALESCE(a.deadline_at, a.started_at, a.created_at)
                                       + make_interval(secs => p.delay)) <= now()
                            OR a.evidence_lease IS NOT DISTINCT FROM $5)
                     ORDER BY a.evidence_lease IS NOT DISTINCT FROM $5 DESC, a.id
                     LIMIT $4
                     FOR UPDATE OF a SKIP LOCKED
                   )
                   UPDATE attempts a
                   SET evidence_next_at = now() + make_interval(secs => $3),
                       evidence_looks = a.evidence_looks
                         + CASE WHEN a.evidence_lease IS NOT DISTINCT FROM $5 THEN 0 ELSE 1 END,
                       evidence_lease = $5
                   FROM due, jobs j
                   WHERE a.id = due.id AND j.id = a.job_id
                   RETURNING a.id AS "attempt_id: AttemptId", a.job_id AS "job_id: JobId",
                             a.provider, j.operation, j.version, j.input,
                             COALESCE(a.started_at, a.created_at) AS "started_at!",
                             a.evidence_looks AS looks,
                             a.status = 'discarded' AS "discarded!",
                             a.evidence AS asked"#,
                    &names,
                    &delays,
                    lease.as_secs_f64(),
                    limit,
                    token,
                )
                .fetch_all(&self.0.pool)
                .await?)
            })
            .await
    }

    /// Takes the unknown attempt `attempt` for a look now, whenever its next
    /// look was due (an operator asks), under the same lease as the pass's
    /// looks. `None` when it is not `unknown`.
    pub async fn evidence_now(
        self,
        attempt: AttemptId,
        lease: Duration,
    ) -> Result<Option<EvidenceDue>> {
        self.0
            .retrying(|| async {
                Ok(sqlx::query_as!(
                    EvidenceDue,
                    r#"UPDATE attempts a
                   SET evidence_next_at = now() + make_interval(secs => $2),
                       evidence_looks = a.evidence_looks + 1
                   FROM jobs j
                   WHERE a.id = $1 AND a.status = 'unknown' AND j.id = a.job_id
                   RETURNING a.id AS "attempt_id: AttemptId", a.job_id AS "job_id: JobId",
                             a.provider, j.operation, j.version, j.input,
                             COALESCE(a.started_at, a.created_at) AS "started_at!",
                             a.evidence_looks AS looks,
                             false AS "discarded!",
                             a.evidence AS asked"#,
                    attempt.0,
                    lease.as_secs_f64(),
                )
                .fetch_optional(&self.0.pool)
                .await?)
            })
            .await
    }

    /// Writes what a look found, and when the next may come, `None` for no
    /// more looks (only an attempt still `unknown`, or discarded with its
    /// cost not known, is looked at again; a settled one keeps the note of
    /// what settled it).
    pub async fn note_evidence(
        self,
        attempt: AttemptId,
        note: &str,
        next_in: Option<Duration>,
    ) -> Result<()> {
        // No more looks: a discarded attempt's next look is NULL (it is looked
        // at only while it has one, and counts in its owner's flight until
        // then); an unknown one's is a century away (NULL would make it due).
        let next_in = next_in.map(|d| d.as_secs_f64());
        self.0
            .retrying(|| async {
                sqlx::query!(
                    "UPDATE attempts SET evidence_note = $2, evidence_last_at = now(),
                     evidence_next_at = CASE
                         WHEN $3::float8 IS NOT NULL THEN now() + make_interval(secs => $3)
                         WHEN status = 'discarded' THEN NULL
                         ELSE now() + interval '100 years' END
                 WHERE id = $1",
                    attempt.0,
                    note,
                    next_in,
                )
                .execute(&self.0.pool)
                .await?;
                Ok(())
            })
            .await
    }
}

impl Evidence<'_> {
    /// Keeps what a discarded attempt's call cost, as evidence found it, with
    /// what was found, in one statement: its usage and request id (if none
    /// were kept yet), and no more looks.
    pub async fn record_cost(
        self,
        attempt: AttemptId,
        usage: Option<&Value>,
        request_id: Option<&str>,
        note: &str,
    ) -> Result<()> {
        self.0
            .retrying(|| async {
                sqlx::query!(
                    "UPDATE attempts SET usage = COALESCE(usage, $2),
                     provider_request_id = COALESCE(provider_request_id, $3),
                     evidence_note = $4, evidence_last_at = now(),
                     evidence_next_at = NULL
                 WHERE id = $1 AND status = 'discarded'",
                    attempt.0,
                    usage,
                    request_id,
                    note,
                )
                .execute(&self.0.pool)
                .await?;
                Ok(())
            })
            .await
    }
}

/// What qualification last found of a provider's evidence claim.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvidenceClaim {
    /// The kind of evidence checked: `stored` or `idempotency_key`.
    pub kind: String,
    /// Whether the provider kept the evidence it was said to keep.
    pub held: bool,
    /// What the check saw.
    pub detail: String,
    /// When.
    pub checked_at: DateTime<Utc>,
}

impl Evidence<'_> {
    /// Records what a qualification found of `provider`'s evidence claim.
    pub async fn record_claim(
        self,
        provider: &str,
        kind: &str,
        held: bool,
        detail: &str,
    ) -> Result<()> {
        self.0
            .retrying(|| async {
                sqlx::query!(
                    "INSERT INTO evidence_claims (id, provider, kind, held, detail)
                 VALUES ($1, $2, $3, $4, $5)",
                    Uuid::now_v7(),
                    provider,
                    kind,
                    held,
                    detail,
                )
                .execute(&self.0.pool)
                .await?;
                Ok(())
            })
            .await
    }

    /// Each provider's latest claim check, by provider.
    pub async fn latest_claims(self) -> Result<HashMap<String, EvidenceClaim>> {
        Ok(sqlx::query!(
            r#"SELECT DISTINCT ON (provider) provider, kind, held, detail, checked_at
               FROM evidence_claims ORDER BY provider, checked_at DESC, id DESC"#
        )
        .fetch_all(&self.0.pool)
        .await?
        .into_iter()
        .map(|r| {
            let claim = EvidenceClaim {
                kind: r.kind,
                held: r.held,
                detail: r.detail,
                checked_at: r.checked_at,
            };
            (r.provider, claim)
        })
        .collect())
    }
}
