//! What needs an operator's eye at a glance: the overview's counts, and every
//! attempt in `unknown` blocking its job.

use crate::edges::store::handles::Jobs;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::edges::store::error::Result;

/// An attempt in `unknown`, blocking its job.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Unknown {
    /// The attempt.
    pub attempt_id: Uuid,
    /// Its job.
    pub job_id: Uuid,
    /// Its number within the job.
    pub number: i32,
    /// The provider it was sent to.
    pub provider: String,
    /// The provider's request id, if it answered with one.
    pub provider_request_id: Option<String>,
    /// The job's owner.
    pub owner_id: String,
    /// The job's operation.
    pub operation: String,
    /// When it started (or was created, if it never started).
    pub since: DateTime<Utc>,
    /// Seconds since then.
    pub age_seconds: f64,
    /// Why it is unknown.
    pub error: Option<String>,
    /// Looks taken at the provider's evidence.
    pub evidence_looks: i32,
    /// When the last look ended.
    pub evidence_last_at: Option<DateTime<Utc>>,
    /// What the last look found.
    pub evidence_note: Option<String>,
    /// When the next look may come.
    pub evidence_next_at: Option<DateTime<Utc>>,
}

/// The overview's counts.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Overview {
    /// Jobs by status (every status, zero included).
    pub jobs: Vec<(String, i64)>,
    /// Attempts that finished in the last hour, by provider and status.
    pub attempts_last_hour: Vec<(String, String, i64)>,
    /// Jobs created in each of the last 60 minutes, oldest first.
    pub created_per_minute: Vec<i64>,
    /// Seconds since the oldest unknown attempt started.
    pub oldest_unknown_seconds: Option<f64>,
    /// Unpublished outbox rows, and seconds since the oldest became due.
    pub outbox_pending: i64,
    /// Seconds since the oldest unpublished outbox row became due.
    pub outbox_lag_seconds: Option<f64>,
}

impl Jobs<'_> {
    /// Every attempt in `unknown`, the oldest first.
    pub async fn unknowns(self) -> Result<Vec<Unknown>> {
        Ok(sqlx::query_as!(
            Unknown,
            r#"SELECT a.id AS attempt_id, a.job_id, a.number, a.provider, a.provider_request_id,
                      j.owner_id, j.operation, coalesce(a.started_at, a.created_at) AS "since!",
                      extract(epoch FROM now() - coalesce(a.started_at, a.created_at))::float8 AS "age_seconds!",
                      a.error, a.evidence_looks, a.evidence_last_at, a.evidence_note, a.evidence_next_at
               FROM attempts a JOIN jobs j ON j.id = a.job_id
               WHERE a.status = 'unknown'
               ORDER BY coalesce(a.started_at, a.created_at), a.id"#
        )
        .fetch_all(&self.0.pool)
        .await?)
    }

    /// The overview's counts: exact, by the status index, the pending outbox
    /// index and the primary key's last hour.
    pub async fn overview(self) -> Result<Overview> {
        let jobs = sqlx::query!(
            r#"SELECT s.status AS "status!", count(j.id) AS "n!"
               FROM unnest(ARRAY['queued', 'running', 'unknown', 'succeeded', 'failed', 'cancelled']) s(status)
               LEFT JOIN jobs j ON j.status = s.status
               GROUP BY s.status ORDER BY array_position(ARRAY['queued', 'running', 'unknown', 'succeeded', 'failed', 'cancelled'], s.status)"#
        )
        .fetch_all(&self.0.pool)
        .await?
        .into_iter()
        .map(|r| (r.status, r.n))
        .collect();
        let attempts_last_hour = sqlx::query!(
            r#"SELECT provider AS "provider!", status AS "status!", count(*) AS "n!" FROM attempts
               WHERE finished_at > now() - interval '1 hour'
               GROUP BY provider, status ORDER BY provider, status"#
        )
        .fetch_all(&self.0.pool)
        .await?
        .into_iter()
        .map(|r| (r.provider, r.status, r.n))
        .collect();
        // Job ids are UUIDv7: their first 48 bits are the creation time in
        // milliseconds, so the last hour is a range of the primary key.
        let start_ms = Utc::now().timestamp_millis() - 3_600_000;
        let floor = Uuid::from_u128(u128::from(start_ms.max(0) as u64) << 80);
        // And no later than the next minute: an id that is not a UUIDv7 (a
        // row another program wrote) must not count, nor overflow the minute.
        let ceiling = Uuid::from_u128(u128::from((start_ms + 3_660_000).max(0) as u64) << 80);
        let mut created_per_minute = vec![0i64; 60];
        for r in sqlx::query!(
            r#"SELECT ((('x' || left(replace(j.id::text, '-', ''), 12))::bit(48)::bigint - $1) / 60000)::int AS "minute!",
                      count(*) AS "n!"
               FROM jobs j WHERE j.id >= $2 AND j.id < $3 GROUP BY 1"#,
            start_ms,
            floor,
            ceiling
        )
        .fetch_all(&self.0.pool)
        .await?
        {
            if let Some(n) = usize::try_from(r.minute)
                .ok()
                .and_then(|m| created_per_minute.get_mut(m))
            {
                *n += r.n;
            }
        }
        let row = sqlx::query!(
            r#"SELECT
                 (SELECT extract(epoch FROM now() - min(coalesce(started_at, created_at)))::float8
                  FROM attempts WHERE status = 'unknown') AS oldest_unknown,
                 (SELECT count(*) FROM outbox WHERE published_at IS NULL) AS "pending!",
                 (SELECT extract(epoch FROM now() - min(not_before))::float8
                  FROM outbox WHERE published_at IS NULL AND not_before <= now()) AS lag"#
        )
        .fetch_one(&self.0.pool)
        .await?;
        Ok(Overview {
            jobs,
            attempts_last_hour,
            created_per_minute,
            oldest_unknown_seconds: row.oldest_unknown,
            outbox_pending: row.pending,
            outbox_lag_seconds: row.lag,
        })
    }
}
