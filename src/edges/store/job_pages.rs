//! Jobs a page at a time, newest first by keyset, and the outbox messages
//! still kept for one job.

use crate::edges::store::handles::Jobs;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::domain::JobStatus;
use crate::edges::store::error::Result;
use crate::edges::store::views::JobView;

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

impl Jobs<'_> {
    /// A page of jobs, newest first, after the job `after` (the last of the
    /// previous page): by keyset on the id (UUIDv7, time-ordered), never by
    /// offset. Each combination of filters is its own statement, so each gets a
    /// plan that uses its indexes.
    pub async fn page(
        self,
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
        Ok(q.build_query_as::<JobLine>()
            .fetch_all(&self.0.pool)
            .await?)
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

impl Jobs<'_> {
    /// The outbox rows still kept for `job`: its attempts' messages and its
    /// events (published ones go after `outbox_retention`), and the message
    /// a held turn carries until it is handed out. Found by message
    /// id, through the `outbox_message_id` index.
    pub async fn job_messages(self, job: &JobView) -> Result<Vec<JobMessage>> {
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
        .fetch_all(&self.0.pool)
        .await?)
    }
}
