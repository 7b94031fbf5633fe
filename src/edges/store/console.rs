//! What the operator console reads: its sessions, pages of jobs, the unknowns,
//! the overview's counts.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::domain::JobStatus;
use crate::edges::store::Store;
use crate::edges::store::error::Result;
use crate::edges::store::views::JobView;
use crate::settings::token::Token;

/// A signed-in console session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    /// The operator it signs in.
    pub operator: String,
    /// The session's form token (CSRF): every action must carry it.
    pub csrf: String,
}

/// Which jobs a page lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobFilter {
    /// Only this status.
    pub status: Option<JobStatus>,
    /// Only this owner's.
    pub owner: Option<String>,
    /// Only this operation's.
    pub operation: Option<String>,
    /// Only jobs with an attempt on this provider.
    pub provider: Option<String>,
    /// Only jobs created at or after this.
    pub since: Option<DateTime<Utc>>,
    /// Only jobs created before this.
    pub until: Option<DateTime<Utc>>,
}

/// A job as a list shows it.
#[derive(Clone, Debug, PartialEq, Serialize, sqlx::FromRow)]
pub struct JobLine {
    /// The job.
    pub id: Uuid,
    /// Owner.
    pub owner_id: String,
    /// Idempotency key.
    pub idempotency_key: String,
    /// Operation.
    pub operation: String,
    /// Status.
    pub status: String,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

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

impl Store {
    /// Deletes the sessions past their expiry (a timer of the console's
    /// calls it); how many.
    pub async fn expire_sessions(&self) -> Result<u64> {
        Ok(
            sqlx::query!("DELETE FROM operator_sessions WHERE expires_at < now()")
                .execute(&self.pool)
                .await?
                .rows_affected(),
        )
    }

    /// Signs in with an operator token: a new session of `ttl`, whose id's
    /// digest is `session_digest`. The operator, or `None` when the token is
    /// unknown or revoked.
    pub async fn sign_in(
        &self,
        token: &Token,
        session_digest: &str,
        csrf: &str,
        ttl: Duration,
    ) -> Result<Option<String>> {
        Ok(sqlx::query_scalar!(
            r#"WITH t AS (
                   SELECT id, operator FROM operator_tokens
                   WHERE token_sha256 = $1 AND revoked_at IS NULL
               ),
               made AS (
                   INSERT INTO operator_sessions (id_sha256, token_id, csrf, expires_at)
                   SELECT $2, t.id, $3, now() + make_interval(secs => $4) FROM t
                   RETURNING token_id
               )
               SELECT t.operator AS "operator!" FROM t JOIN made ON made.token_id = t.id"#,
            token.digest(),
            session_digest,
            csrf,
            ttl.as_secs_f64()
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The live session whose id has this digest: not expired, not signed out,
    /// its token not revoked.
    pub async fn session(&self, session_digest: &str) -> Result<Option<Session>> {
        Ok(sqlx::query_as!(
            Session,
            "SELECT t.operator, s.csrf FROM operator_sessions s
             JOIN operator_tokens t ON t.id = s.token_id
             WHERE s.id_sha256 = $1 AND s.expires_at > now() AND t.revoked_at IS NULL",
            session_digest
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Ends a session.
    pub async fn sign_out(&self, session_digest: &str) -> Result<()> {
        sqlx::query!(
            "DELETE FROM operator_sessions WHERE id_sha256 = $1",
            session_digest
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// A page of jobs, newest first, after the job `after` (the last of the
    /// previous page): by keyset on the id (UUIDv7, time-ordered), never by
    /// offset. Each combination of filters is its own statement, so each gets a
    /// plan that uses its indexes.
    pub async fn jobs_page(
        &self,
        filter: &JobFilter,
        after: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<JobLine>> {
        let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new(
            "SELECT j.id, j.owner_id, j.idempotency_key, j.operation, j.status, j.created_at, \
             j.updated_at FROM ",
        );
        match &filter.provider {
            // Driven from the provider's attempts, newest job first, through
            // `attempts_provider_job`: a provider that few jobs used reads only
            // those, where walking the jobs and asking each would read them all.
            Some(provider) => {
                q.push("(SELECT DISTINCT a.job_id FROM attempts a WHERE a.provider = ")
                    .push_bind(provider.clone());
                if let Some(after) = after {
                    q.push(" AND a.job_id < ").push_bind(after);
                }
                q.push(" ORDER BY a.job_id DESC) p JOIN jobs j ON j.id = p.job_id WHERE true");
            }
            None => {
                q.push("jobs j WHERE true");
            }
        }
        if let Some(status) = filter.status {
            q.push(" AND j.status = ").push_bind(status.as_str());
        }
        if let Some(owner) = &filter.owner {
            q.push(" AND j.owner_id = ").push_bind(owner.clone());
        }
        if let Some(operation) = &filter.operation {
            q.push(" AND j.operation = ").push_bind(operation.clone());
        }
        if let Some(since) = filter.since {
            q.push(" AND j.created_at >= ").push_bind(since);
        }
        if let Some(until) = filter.until {
            q.push(" AND j.created_at < ").push_bind(until);
        }
        if let Some(after) = after {
            q.push(" AND j.id < ").push_bind(after);
        }
        q.push(" ORDER BY j.id DESC LIMIT ").push_bind(limit);
        Ok(q.build_query_as::<JobLine>().fetch_all(&self.pool).await?)
    }

    /// Every attempt in `unknown`, the oldest first.
    pub async fn unknowns(&self) -> Result<Vec<Unknown>> {
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
        .fetch_all(&self.pool)
        .await?)
    }

    /// The overview's counts: exact, by the status index, the pending outbox
    /// index and the primary key's last hour.
    pub async fn overview(&self) -> Result<Overview> {
        let jobs = sqlx::query!(
            r#"SELECT s.status AS "status!", count(j.id) AS "n!"
               FROM unnest(ARRAY['queued', 'running', 'unknown', 'succeeded', 'failed', 'cancelled']) s(status)
               LEFT JOIN jobs j ON j.status = s.status
               GROUP BY s.status ORDER BY array_position(ARRAY['queued', 'running', 'unknown', 'succeeded', 'failed', 'cancelled'], s.status)"#
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r| (r.status, r.n))
        .collect();
        let attempts_last_hour = sqlx::query!(
            r#"SELECT provider AS "provider!", status AS "status!", count(*) AS "n!" FROM attempts
               WHERE finished_at > now() - interval '1 hour'
               GROUP BY provider, status ORDER BY provider, status"#
        )
        .fetch_all(&self.pool)
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
        .fetch_all(&self.pool)
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
        .fetch_one(&self.pool)
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

/// A message the outbox wrote for a job: an attempt's message or a job event.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobMessage {
    /// Its message id: the attempt's id, or `JOB:VERSION` for an event.
    pub message_id: String,
    /// The exchange it goes to.
    pub exchange: String,
    /// Its routing key (`job.succeeded`, or the provider's attempts key).
    pub routing_key: String,
    /// When it was written.
    pub created_at: DateTime<Utc>,
    /// Not published before this (an attempt's backoff, or its owner's
    /// rate); `None` while its turn is held: it is not due until handed out.
    pub not_before: Option<DateTime<Utc>>,
    /// When the broker confirmed it; `None` while it waits.
    pub published_at: Option<DateTime<Utc>>,
}

impl Store {
    /// The outbox rows still kept for `job`: its attempts' messages and its
    /// events (published ones go after `outbox_retention`), and the message
    /// a held turn carries until it is handed out. Found by message
    /// id, through the `outbox_message_id` index.
    pub async fn job_messages(&self, job: &JobView) -> Result<Vec<JobMessage>> {
        let mut ids: Vec<String> = job.attempts.iter().map(|a| a.id.to_string()).collect();
        // An event's id is the job's id and the version it was written at;
        // the newest 1,000 versions (a job's event is written when it ends).
        ids.extend(((job.version - 999).max(1)..=job.version).map(|v| format!("{}:{v}", job.id)));
        Ok(sqlx::query_as!(
            JobMessage,
            // A held turn's row is not due ('infinity', which no
            // DateTime holds): None. A turn held at admission carries its
            // message until it is handed out (no row yet): shown as held.
            r#"SELECT message_id AS "message_id!", exchange AS "exchange!",
                      routing_key AS "routing_key!", created_at AS "created_at!",
                      not_before, published_at
               FROM (SELECT id, message_id, exchange, routing_key, created_at,
                            NULLIF(not_before, 'infinity') AS not_before, published_at
                     FROM outbox WHERE message_id = ANY($1)
                     UNION ALL
                     SELECT 0, t.attempt_id::text, t.exchange, t.routing_key, a.created_at,
                            NULL, NULL
                     FROM turns t JOIN attempts a ON a.id = t.attempt_id
                     WHERE t.attempt_id::text = ANY($1) AND t.body IS NOT NULL
                       AND t.handed_out_at IS NULL) m
               ORDER BY created_at, id"#,
            &ids
        )
        .fetch_all(&self.pool)
        .await?)
    }
}
