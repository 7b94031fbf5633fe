//! All SQL lives here.
//!
//! Every state change is one guarded statement (`UPDATE … WHERE status = …`, the
//! compare-and-swap `WHERE version = $v AND completed_by IS NULL`), so two workers
//! that both believe they own a row cannot both act: the one that changes zero rows
//! backs off. Every entry point takes a slice and settles all of it with constant
//! SQL text over `UNNEST` arrays, so batching is a caller's choice, not a rewrite.
//! Settlements take locks attempts first, then jobs, so that concurrent batches do
//! not deadlock one another. A few statements must decide under the job's lock
//! before they touch its attempts (`start`, `cancel`, and the clean-up after a
//! win), so they take the job first; against a settlement of the same job that
//! can deadlock, which Postgres detects, and the loser's transaction is retried
//! whole, as is any deadlock or serialization failure.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use chrono::{DateTime, Utc};
use futures_util::TryFutureExt;
use serde::Serialize;
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use crate::intent::{Fingerprint, Intent};
use crate::token::Token;

/// The migrations, embedded in every binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// A storage failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed a statement.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    /// A migration failed.
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A row holds something the code does not understand.
    #[error("corrupt row: {0}")]
    Corrupt(String),
}

/// Result alias for the store.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

impl StoreError {
    /// A table is missing: the database was never migrated.
    pub fn is_undefined_table(&self) -> bool {
        matches!(self, StoreError::Db(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P01"))
    }

    /// Data the database refuses (SQLSTATE class 22: a string it cannot store, a
    /// number out of range): running the statement again cannot help.
    pub fn is_data_error(&self) -> bool {
        matches!(self, StoreError::Db(sqlx::Error::Database(db)) if db.code().is_some_and(|c| c.starts_with("22")))
    }

    /// One line saying what went wrong, naming the URL (its password masked):
    /// unreachable, a refused login and a missing database are told apart, since
    /// each has its own remedy.
    pub fn describe(&self, url: &str) -> String {
        let at = crate::broker::redact_url(url);
        match self {
            StoreError::Db(sqlx::Error::Database(db)) => match db.code().as_deref() {
                Some("28P01" | "28000") => {
                    format!("Postgres at {at} refused the login: {}", db.message())
                }
                Some("3D000") => format!(
                    "Postgres at {at} has no such database ({}); `onejob migrate` creates it",
                    db.message()
                ),
                _ => format!("Postgres at {at}: {}", db.message()),
            },
            StoreError::Db(sqlx::Error::Io(io)) => format!("cannot reach Postgres at {at}: {io}"),
            StoreError::Db(sqlx::Error::PoolTimedOut) => {
                format!("cannot reach Postgres at {at}: no connection within the timeout")
            }
            other => format!("Postgres at {at}: {other}"),
        }
    }

    /// Postgres cannot be reached (or is starting, stopping, out of connections):
    /// the failure is the dependency's, not the data's. Work waiting on it is held,
    /// never handed back against its delivery limit.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Db(
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::Tls(_),
            ) => true,
            StoreError::Db(sqlx::Error::Database(db)) => db
                .code()
                .is_some_and(|c| c.starts_with("08") || c.starts_with("57P") || c == "53300"),
            _ => false,
        }
    }

    /// The SQLSTATE of a retried failure, or `io`, for the retry counter.
    fn retry_code(&self) -> String {
        match self {
            StoreError::Db(sqlx::Error::Database(db)) => {
                db.code().map_or("other".to_owned(), |c| c.into_owned())
            }
            StoreError::Db(sqlx::Error::Io(_)) => "io".to_owned(),
            _ => "other".to_owned(),
        }
    }

    /// Deadlocks and serialization failures: the transaction can simply run again.
    fn is_transient(&self) -> bool {
        match self {
            StoreError::Db(sqlx::Error::Database(db)) => {
                matches!(db.code().as_deref(), Some("40001" | "40P01"))
            }
            StoreError::Db(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) => true,
            _ => false,
        }
    }
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// A message to publish because of a commit, written in that commit's transaction.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxDraft {
    /// The exchange.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The AMQP `message_id`; consumers deduplicate on it.
    pub message_id: String,
    /// The JSON body.
    pub body: Value,
    /// Not published before this time; `None` publishes at once, by the writer.
    pub not_before: Option<DateTime<Utc>>,
}

/// An outbox row this process holds the lease on and should publish now.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxMessage {
    /// The row id.
    pub id: i64,
    /// The exchange.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The AMQP `message_id`.
    pub message_id: String,
    /// The JSON body.
    pub body: Value,
}

/// One intent ready to become a job.
#[derive(Clone, Debug)]
pub struct NewJob {
    /// The id the job gets if it is created.
    pub job_id: JobId,
    /// The id its first attempt gets.
    pub attempt_id: AttemptId,
    /// The validated intent.
    pub intent: Intent,
    /// Its fingerprint.
    pub fingerprint: Fingerprint,
    /// The first attempt's provider.
    pub provider: String,
}

/// What became of one intent.
#[derive(Clone, Debug, PartialEq)]
pub enum Admission {
    /// A new job and its first attempt.
    Created {
        /// The job.
        job_id: JobId,
        /// The attempt message to publish.
        publish: OutboxMessage,
    },
    /// The identity exists with the same fingerprint.
    Duplicate {
        /// The existing job.
        job_id: JobId,
    },
    /// The identity exists with another fingerprint.
    Conflict,
}

/// An attempt this worker has just moved `queued → started`.
#[derive(Clone, Debug)]
pub struct Started {
    /// The attempt.
    pub attempt_id: AttemptId,
    /// Its job.
    pub job_id: JobId,
    /// Its number within the job.
    pub number: i32,
    /// The job's version when the attempt started: the compare-and-swap's guard.
    pub version: i64,
    /// The job's operation.
    pub operation: String,
    /// The job's input.
    pub input: serde_json::Map<String, Value>,
}

/// How an attempt ended, as its worker saw it.
#[derive(Clone, Debug)]
pub enum Verdict {
    /// A valid answer.
    Succeeded(Value),
    /// A definite failure. `retryable` is false when no provider could do better
    /// (the input does not render, say).
    Failed {
        /// Why.
        error: String,
        /// Whether another attempt may follow.
        retryable: bool,
        /// How long the provider asked to be left alone (HTTP 429 `Retry-After`).
        retry_after: Option<Duration>,
    },
    /// The outcome is not known: a timeout, or a connection lost after sending.
    Unknown {
        /// Why.
        error: String,
    },
}

/// One finished call, to be settled.
#[derive(Clone, Debug)]
pub struct Finished {
    /// The attempt.
    pub attempt_id: AttemptId,
    /// Its job.
    pub job_id: JobId,
    /// The job version read when the attempt started.
    pub version: i64,
    /// The provider's response id, if it answered.
    pub provider_request_id: Option<String>,
    /// What the provider reported it spent, if it answered.
    pub usage: Option<Value>,
    /// The outcome.
    pub verdict: Verdict,
}

/// What settling one finished attempt did.
#[derive(Clone, Debug, PartialEq)]
pub enum Settled {
    /// Its result won the compare-and-swap and is the job's result.
    Won,
    /// Another attempt had already won, or the job had ended: dropped.
    Discarded {
        /// The attempt whose result is the job's, if any.
        winner: Option<AttemptId>,
    },
    /// A definite failure; a next attempt may have been scheduled.
    Failed {
        /// The next attempt, if one was created.
        next: Option<AttemptId>,
        /// Whether the job failed for good.
        job_failed: bool,
    },
    /// The attempt and its job are now `unknown`.
    Unknown,
    /// The attempt was no longer open (resolved out-of-band): nothing changed.
    Stale,
}

/// A job whose attempt just failed definitely, for the caller to plan what follows.
#[derive(Clone, Debug)]
pub struct FailedJob {
    /// The job.
    pub job_id: JobId,
    /// Its operation.
    pub operation: String,
    /// The provider that failed.
    pub failed_provider: String,
    /// Attempts made so far, the failed one included.
    pub attempts_made: u32,
    /// The failure.
    pub error: String,
    /// Whether another attempt may follow at all.
    pub retryable: bool,
    /// The failed provider's `Retry-After`, if it sent one.
    pub retry_after: Option<Duration>,
}

/// What follows a definite failure.
#[derive(Clone, Debug, PartialEq)]
pub enum NextStep {
    /// Another attempt on `provider`, after `delay`.
    Retry {
        /// The provider.
        provider: String,
        /// The backoff before it is published.
        delay: Duration,
    },
    /// No more attempts: the job fails with `error`.
    GiveUp {
        /// The job's error.
        error: String,
    },
}

/// How an operator resolves an open attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// A definite failure: the route rule picks the next attempt.
    Failed,
    /// Ended out-of-band: the job is cancelled with it.
    Cancelled,
}

/// Why an operator action was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No such row.
    #[error("{0} not found")]
    NotFound(String),
    /// The row is terminal.
    #[error("{0}")]
    Terminal(String),
}

impl Refusal {
    fn terminal_job(job: impl std::fmt::Display, status: JobStatus) -> Refusal {
        Refusal::Terminal(format!(
            "job {job} is already {status}: a terminal job never changes"
        ))
    }
}

/// A job as operators see it.
#[derive(Clone, Debug, Serialize)]
pub struct JobView {
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
    /// Input.
    pub input: Value,
    /// The pinned provider, if any.
    pub provider: Option<String>,
    /// Status.
    pub status: JobStatus,
    /// Version.
    pub version: i64,
    /// The winning attempt.
    pub completed_by: Option<AttemptId>,
    /// Result.
    pub result: Option<Value>,
    /// Error.
    pub error: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
    /// Its attempts, by number.
    pub attempts: Vec<AttemptView>,
}

/// A gateway token as operators see it: never the secret.
#[derive(Clone, Debug, Serialize)]
pub struct TokenView {
    /// The token's id.
    pub id: Uuid,
    /// Whose jobs it reaches.
    pub owner_id: String,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it was revoked, if it was.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// An attempt as operators see it.
#[derive(Clone, Debug, Serialize)]
pub struct AttemptView {
    /// The attempt id.
    pub id: AttemptId,
    /// Its job.
    pub job_id: JobId,
    /// Its number within the job.
    pub number: i32,
    /// Provider.
    pub provider: String,
    /// Status.
    pub status: AttemptStatus,
    /// Error.
    pub error: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Not published before.
    pub not_before: DateTime<Utc>,
    /// Started.
    pub started_at: Option<DateTime<Utc>>,
    /// Finished.
    pub finished_at: Option<DateTime<Utc>>,
    /// The provider's response id.
    pub provider_request_id: Option<String>,
    /// What the provider reported it spent.
    pub usage: Option<Value>,
}

/// The event published when a job reaches a terminal state.
#[derive(Clone, Debug, Serialize)]
struct JobEvent<'a> {
    event_id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    job_id: JobId,
    version: i64,
    owner_id: &'a str,
    idempotency_key: &'a str,
    operation: &'a str,
    status: &'static str,
    completed_by: Option<AttemptId>,
    result: Option<&'a Value>,
    error: Option<&'a str>,
    occurred_at: DateTime<Utc>,
}

/// Exchange and routing names the store writes into outbox rows.
#[derive(Clone, Debug)]
pub struct Routes {
    /// Where attempt messages go (`onejob`).
    pub work_exchange: String,
    /// Where job events go (`onejob.events`).
    pub events_exchange: String,
    /// How long a publisher owns a row it just wrote.
    pub lease: Duration,
}

impl Routes {
    fn attempt_draft(
        &self,
        attempt: AttemptId,
        job: JobId,
        provider: &str,
        not_before: Option<DateTime<Utc>>,
    ) -> OutboxDraft {
        OutboxDraft {
            exchange: self.work_exchange.clone(),
            routing_key: crate::broker::attempts_routing_key(provider),
            message_id: attempt.to_string(),
            body: serde_json::json!({ "attempt_id": attempt, "job_id": job }),
            not_before,
        }
    }

    fn event_draft(&self, event: &JobEvent<'_>) -> OutboxDraft {
        OutboxDraft {
            exchange: self.events_exchange.clone(),
            routing_key: event.kind.to_owned(),
            message_id: event.event_id.clone(),
            body: serde_json::to_value(event).unwrap_or(Value::Null),
            not_before: None,
        }
    }
}

/// The job columns an event needs, as returned by the statements that end a job.
struct Ended {
    job_id: Uuid,
    version: i64,
    owner_id: String,
    idempotency_key: String,
    operation: String,
    status: String,
    completed_by: Option<Uuid>,
    result: Option<Value>,
    error: Option<String>,
}

impl Ended {
    fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self> {
        Ok(Ended {
            job_id: row.try_get("id")?,
            version: row.try_get("version")?,
            owner_id: row.try_get("owner_id")?,
            idempotency_key: row.try_get("idempotency_key")?,
            operation: row.try_get("operation")?,
            status: row.try_get("status")?,
            completed_by: row.try_get("completed_by")?,
            result: row.try_get("result")?,
            error: row.try_get("error")?,
        })
    }

    fn draft(&self, routes: &Routes) -> OutboxDraft {
        let (kind, status) = match self.status.as_str() {
            "succeeded" => ("job.succeeded", "succeeded"),
            "failed" => ("job.failed", "failed"),
            _ => ("job.cancelled", "cancelled"),
        };
        routes.event_draft(&JobEvent {
            event_id: format!("{}:{}", self.job_id, self.version),
            kind,
            job_id: JobId(self.job_id),
            version: self.version,
            owner_id: &self.owner_id,
            idempotency_key: &self.idempotency_key,
            operation: &self.operation,
            status,
            completed_by: self.completed_by.map(AttemptId),
            result: self.result.as_ref(),
            error: self.error.as_deref(),
            occurred_at: Utc::now(),
        })
    }
}

/// The Postgres side of onejob.
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
    routes: Routes,
}

impl Store {
    /// Connects a small pool. While the database is unreachable it retries with
    /// backoff for up to `patience` (zero: one try), so a worker started before
    /// Postgres waits for it and a CLI fails at once with the reason.
    pub async fn connect(
        url: &str,
        max_connections: u32,
        routes: Routes,
        patience: Duration,
    ) -> Result<Store> {
        let options: PgConnectOptions = url.parse()?;
        let deadline = std::time::Instant::now() + patience;
        // One plain connection first: it fails fast, where a pool would keep
        // retrying until its acquire timeout.
        let probe = || async { <PgConnection as sqlx::Connection>::connect_with(&options).await };
        let conn = probe
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(100))
                    .with_max_delay(Duration::from_secs(2))
                    .without_max_times(),
            )
            .when(|e| matches!(e, sqlx::Error::Io(_)) && std::time::Instant::now() < deadline)
            .notify(|e, d| tracing::warn!(error = %e, retry_in = ?d, "database not reachable yet"))
            .await?;
        let _ = sqlx::Connection::close(conn).await;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        Ok(Store { pool, routes })
    }

    /// Creates the database `url` names if it does not exist yet, so a fresh
    /// machine needs no manual `CREATE DATABASE`. Two pods racing here is harmless:
    /// the loser's "already exists" is ignored.
    pub async fn ensure_database(url: &str) -> Result<()> {
        use sqlx::migrate::MigrateDatabase;
        if !sqlx::Postgres::database_exists(url).await? {
            if let Err(e) = sqlx::Postgres::create_database(url).await
                && !sqlx::Postgres::database_exists(url).await.unwrap_or(false)
            {
                return Err(e.into());
            }
            tracing::info!("created the database");
        }
        Ok(())
    }

    /// Whether Postgres answers.
    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    /// The pool, for health checks.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations. sqlx holds an advisory lock meanwhile, so
    /// concurrent pods starting together are safe.
    pub async fn migrate(&self) -> Result<()> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// Runs `f` again when it fails with a deadlock or serialization failure.
    async fn retrying<T, F, Fut>(&self, f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        f.retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(5))
                .with_max_delay(Duration::from_millis(500))
                .with_max_times(10)
                .with_jitter(),
        )
        .when(StoreError::is_transient)
        .notify(|e, d| {
            crate::metrics::db_retry(&e.retry_code());
            tracing::debug!(error = %e, retry_in = ?d, "transient database error; retrying")
        })
        .await
    }

    async fn insert_outbox(
        &self,
        conn: &mut PgConnection,
        drafts: &[OutboxDraft],
    ) -> Result<Vec<OutboxMessage>> {
        if drafts.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(
            "INSERT INTO outbox (exchange, routing_key, message_id, body, not_before, lease_until)
             SELECT d.exchange, d.routing_key, d.message_id, d.body, COALESCE(d.not_before, now()),
                    CASE WHEN d.not_before IS NULL THEN now() + make_interval(secs => $6) END
             FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::timestamptz[])
                  AS d(exchange, routing_key, message_id, body, not_before)
             RETURNING id, exchange, routing_key, message_id, body, lease_until IS NOT NULL AS leased",
        )
        .bind(drafts.iter().map(|d| d.exchange.clone()).collect::<Vec<_>>())
        .bind(drafts.iter().map(|d| d.routing_key.clone()).collect::<Vec<_>>())
        .bind(drafts.iter().map(|d| d.message_id.clone()).collect::<Vec<_>>())
        .bind(drafts.iter().map(|d| d.body.clone()).collect::<Vec<_>>())
        .bind(drafts.iter().map(|d| d.not_before).collect::<Vec<_>>())
        .bind(self.routes.lease.as_secs_f64())
        .fetch_all(&mut *conn)
        .await?;
        // Rows without a not-before time are leased to this writer and handed back
        // for immediate publishing; the relay publishes the others when due.
        rows.iter()
            .filter(|r| r.get::<bool, _>("leased"))
            .map(outbox_message)
            .collect()
    }

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

    /// Moves queued attempts to `started` with one guarded statement and marks their
    /// jobs `running`. An id missing from the result was a duplicate delivery (the
    /// attempt had already left `queued`), belongs to a job that has ended, or to a
    /// job blocked by an `unknown` attempt ([`Store::attempt_state`] tells which).
    ///
    /// The jobs are locked first and their status checked under the lock, so a
    /// timeout that commits meanwhile is seen: a job that just became `unknown` is
    /// never written back to `running`, and no attempt of it starts.
    pub async fn start(
        &self,
        provider: &str,
        ids: &[AttemptId],
        timeout: Duration,
    ) -> Result<Vec<Started>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = ids.iter().map(|a| a.0).collect();
        let rows = self
            .retrying(|| {
                sqlx::query(
                    "WITH claimed AS (
                         SELECT j.id FROM jobs j
                         WHERE j.id IN (SELECT job_id FROM attempts
                                        WHERE id = ANY($1) AND status = 'queued' AND provider = $2)
                           AND j.status IN ('queued', 'running')
                         ORDER BY j.id
                         FOR UPDATE
                     ), started AS (
                         UPDATE attempts a
                         SET status = 'started', started_at = now(),
                             deadline_at = now() + make_interval(secs => $3)
                         FROM claimed c
                         WHERE a.id = ANY($1) AND a.job_id = c.id AND a.status = 'queued'
                           AND a.provider = $2
                         RETURNING a.id, a.job_id, a.number
                     ), running AS (
                         UPDATE jobs j SET status = 'running', updated_at = now()
                         FROM (SELECT DISTINCT job_id FROM started) s
                         WHERE j.id = s.job_id
                         RETURNING j.id, j.version, j.operation, j.input
                     )
                     SELECT s.id, s.job_id, s.number, r.version, r.operation, r.input
                     FROM started s JOIN running r ON r.id = s.job_id",
                )
                .bind(&ids)
                .bind(provider)
                .bind(timeout.as_secs_f64())
                .fetch_all(&self.pool)
                .map_err(StoreError::from)
            })
            .await?;
        rows.iter()
            .map(|r| {
                let input = match r.try_get::<Value, _>("input")? {
                    Value::Object(m) => m,
                    other => return Err(corrupt(format!("job input is not an object: {other}"))),
                };
                Ok(Started {
                    attempt_id: AttemptId(r.try_get("id")?),
                    job_id: JobId(r.try_get("job_id")?),
                    number: r.try_get("number")?,
                    version: r.try_get("version")?,
                    operation: r.try_get("operation")?,
                    input,
                })
            })
            .collect()
    }

    /// Settles finished attempts in one transaction: successes race through the
    /// compare-and-swap, unknowns block their job, failures plan the next attempt
    /// with `plan`. Returns what happened to each, in input order, and the outbox
    /// rows to publish now.
    pub async fn finalize(
        &self,
        finished: &[Finished],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<Settled>, Vec<OutboxMessage>)> {
        if finished.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        self.retrying(|| self.finalize_once(finished, plan)).await
    }

    async fn finalize_once(
        &self,
        finished: &[Finished],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<Settled>, Vec<OutboxMessage>)> {
        let mut tx = self.pool.begin().await?;
        let mut settled: HashMap<AttemptId, Settled> = HashMap::new();
        let mut drafts = Vec::new();

        let wins: Vec<&Finished> = finished
            .iter()
            .filter(|f| matches!(f.verdict, Verdict::Succeeded(_)))
            .collect();
        if !wins.is_empty() {
            let (outcomes, events) = self.settle_successes(&mut tx, &wins).await?;
            settled.extend(outcomes);
            drafts.extend(events);
        }

        let unknowns: Vec<(AttemptId, String)> = finished
            .iter()
            .filter_map(|f| match &f.verdict {
                Verdict::Unknown { error } => Some((f.attempt_id, error.clone())),
                _ => None,
            })
            .collect();
        if !unknowns.is_empty() {
            let mut marked = mark_unknown(&mut tx, &unknowns).await?;
            for (id, _) in &unknowns {
                settled.insert(*id, marked.remove(id).unwrap_or(Settled::Stale));
            }
        }

        let failures: Vec<Failure> = finished
            .iter()
            .filter_map(|f| match &f.verdict {
                Verdict::Failed {
                    error,
                    retryable,
                    retry_after,
                } => Some(Failure {
                    attempt_id: f.attempt_id,
                    error: error.clone(),
                    retryable: *retryable,
                    retry_after: *retry_after,
                    usage: f.usage.clone(),
                    request_id: f.provider_request_id.clone(),
                }),
                _ => None,
            })
            .collect();
        if !failures.is_empty() {
            let (outcomes, more) = self
                .settle_failures(&mut tx, &failures, &["started", "unknown"], plan, false)
                .await?;
            settled.extend(outcomes);
            drafts.extend(more);
        }

        let publish = self.insert_outbox(&mut tx, &drafts).await?;
        tx.commit().await?;
        let outcomes = finished
            .iter()
            .map(|f| settled.remove(&f.attempt_id).unwrap_or(Settled::Stale))
            .collect();
        Ok((outcomes, publish))
    }

    /// The compare-and-swap. Exactly one attempt per job can move `completed_by`
    /// from NULL; every other open attempt that finishes is `discarded`, its usage
    /// kept, its result dropped whole.
    async fn settle_successes(
        &self,
        tx: &mut PgConnection,
        wins: &[&Finished],
    ) -> Result<(Vec<(AttemptId, Settled)>, Vec<OutboxDraft>)> {
        let rows = sqlx::query(
            "WITH input AS (
                 SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::bigint[], $4::jsonb[], $5::jsonb[], $6::text[])
                     AS t(attempt_id, job_id, version, result, usage, request_id)
             ), open AS (
                 SELECT a.id FROM attempts a JOIN input i ON a.id = i.attempt_id AND a.job_id = i.job_id
                 WHERE a.status IN ('started', 'unknown')
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
             SELECT w.id, w.version, w.owner_id, w.idempotency_key, w.operation, w.status,
                    w.completed_by, w.result, w.error, NULL::uuid AS discarded_job
             FROM won w
             UNION ALL
             SELECT NULL, NULL, NULL, NULL, NULL, NULL, s.id, NULL, NULL, i.job_id
             FROM settled s JOIN input i ON i.attempt_id = s.id
             WHERE s.status = 'discarded'",
        )
        .bind(wins.iter().map(|f| f.attempt_id.0).collect::<Vec<_>>())
        .bind(wins.iter().map(|f| f.job_id.0).collect::<Vec<_>>())
        .bind(wins.iter().map(|f| f.version).collect::<Vec<_>>())
        .bind(
            wins.iter()
                .map(|f| match &f.verdict {
                    Verdict::Succeeded(v) => v.clone(),
                    _ => Value::Null,
                })
                .collect::<Vec<_>>(),
        )
        .bind(wins.iter().map(|f| f.usage.clone()).collect::<Vec<_>>())
        .bind(wins.iter().map(|f| f.provider_request_id.clone()).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await?;

        let mut outcomes = Vec::new();
        let mut events = Vec::new();
        let mut discarded: Vec<(AttemptId, Uuid)> = Vec::new();
        for row in &rows {
            match row.try_get::<Option<Uuid>, _>("discarded_job")? {
                Some(job) => {
                    let attempt: Uuid = row.try_get("completed_by")?;
                    discarded.push((AttemptId(attempt), job));
                }
                None => {
                    let ended = Ended::from_row(row)?;
                    let winner = ended
                        .completed_by
                        .ok_or_else(|| corrupt("won job without completed_by"))?;
                    events.push(ended.draft(&self.routes));
                    outcomes.push((AttemptId(winner), Settled::Won));
                }
            }
        }
        let won: Vec<(Uuid, Uuid)> = outcomes
            .iter()
            .filter_map(|(winner, _)| {
                wins.iter()
                    .find(|f| f.attempt_id == *winner)
                    .map(|f| (f.job_id.0, winner.0))
            })
            .collect();
        if !won.is_empty() {
            // The won jobs' other attempts, in a statement of their own: its fresh
            // snapshot sees a timeout that committed while the compare-and-swap
            // waited for the job (which this transaction now holds). An unknown
            // blocks nothing any more: discarded. A queued one will never be needed:
            // cancelled.
            sqlx::query(
                "UPDATE attempts a
                 SET status = CASE WHEN a.status = 'unknown' THEN 'discarded' ELSE 'cancelled' END,
                     finished_at = now(),
                     error = CASE WHEN a.status = 'unknown'
                                  THEN 'discarded: its outcome was still unknown when attempt '
                                       || w.winner || ' won'
                                  ELSE 'cancelled: attempt ' || w.winner || ' won before it started'
                             END
                 FROM unnest($1::uuid[], $2::uuid[]) AS w(job_id, winner)
                 WHERE a.job_id = w.job_id AND a.status IN ('unknown', 'queued')",
            )
            .bind(won.iter().map(|w| w.0).collect::<Vec<_>>())
            .bind(won.iter().map(|w| w.1).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
        }
        if !discarded.is_empty() {
            // A fresh snapshot sees the winner that made our compare-and-swap fail.
            let winners: HashMap<Uuid, Option<Uuid>> = sqlx::query_as::<_, (Uuid, Option<Uuid>)>(
                "SELECT id, completed_by FROM jobs WHERE id = ANY($1)",
            )
            .bind(discarded.iter().map(|(_, j)| *j).collect::<Vec<_>>())
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect();
            for (attempt, job) in discarded {
                let winner = winners.get(&job).copied().flatten().map(AttemptId);
                tracing::info!(
                    job_id = %job,
                    discarded_attempt = %attempt,
                    winning_attempt = ?winner.map(|w| w.to_string()),
                    "late result discarded: the job already has its outcome"
                );
                outcomes.push((attempt, Settled::Discarded { winner }));
            }
        }
        Ok((outcomes, events))
    }

    /// Definite failures: mark the attempts `failed`, then, per job, either create
    /// the next attempt (with its not-before time persisted) or fail the job.
    async fn settle_failures(
        &self,
        tx: &mut PgConnection,
        failures: &[Failure],
        from: &[&str],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
        immediate: bool,
    ) -> Result<(Vec<(AttemptId, Settled)>, Vec<OutboxDraft>)> {
        let failed: Vec<(Uuid, Uuid, String, String)> = sqlx::query_as(
            "UPDATE attempts a
             SET status = 'failed', error = i.error, finished_at = now(),
                 usage = COALESCE(i.usage, a.usage),
                 provider_request_id = COALESCE(i.request_id, a.provider_request_id)
             FROM unnest($1::uuid[], $2::text[], $3::jsonb[], $4::text[])
                  AS i(attempt_id, error, usage, request_id)
             WHERE a.id = i.attempt_id AND a.status = ANY($5)
             RETURNING a.id, a.job_id, a.provider, a.error",
        )
        .bind(failures.iter().map(|f| f.attempt_id.0).collect::<Vec<_>>())
        .bind(failures.iter().map(|f| f.error.clone()).collect::<Vec<_>>())
        .bind(failures.iter().map(|f| f.usage.clone()).collect::<Vec<_>>())
        .bind(
            failures
                .iter()
                .map(|f| f.request_id.clone())
                .collect::<Vec<_>>(),
        )
        .bind(from.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await?;
        let mut outcomes: Vec<(AttemptId, Settled)> = Vec::new();
        if failed.is_empty() {
            return Ok((outcomes, Vec::new()));
        }
        let job_ids: Vec<Uuid> = failed
            .iter()
            .map(|f| f.1)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();

        // Lock the jobs (in id order), then read their attempts in a new statement:
        // its fresh snapshot sees any attempt another transaction committed while we
        // waited for the lock.
        let jobs: HashMap<Uuid, (String, String)> = sqlx::query_as::<_, (Uuid, String, String)>(
            "SELECT id, status, operation FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE",
        )
        .bind(&job_ids)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|(id, status, op)| (id, (status, op)))
        .collect();
        let counts: HashMap<Uuid, AttemptCounts> = sqlx::query_as::<_, AttemptCounts>(
            "SELECT job_id, count(*) AS made, max(number) AS max_number,
                    bool_or(status IN ('queued', 'started', 'unknown')) AS open,
                    bool_or(status = 'unknown') AS unknown,
                    COALESCE(array_agg(id) FILTER (WHERE status = 'queued'), '{}') AS queued,
                    COALESCE(array_agg(provider) FILTER (WHERE status = 'queued'), '{}')
                        AS queued_providers
             FROM attempts WHERE job_id = ANY($1) GROUP BY job_id",
        )
        .bind(&job_ids)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|c| (c.job_id, c))
        .collect();

        let by_attempt: HashMap<Uuid, &Failure> =
            failures.iter().map(|f| (f.attempt_id.0, f)).collect();
        let now = Utc::now();
        let mut next_attempts: Vec<NextAttempt> = Vec::new();
        let mut give_up: Vec<(Uuid, String)> = Vec::new();
        let mut planned: HashMap<Uuid, Option<AttemptId>> = HashMap::new();
        let mut unblocked: Vec<Uuid> = Vec::new();
        let mut lifted: Vec<OutboxDraft> = Vec::new();
        // The failed attempt whose settlement created each next attempt.
        let mut triggered: HashMap<Uuid, AttemptId> = HashMap::new();
        for (attempt, job, provider, error) in &failed {
            let Some((status, operation)) = jobs.get(job) else {
                return Err(corrupt(format!("attempt {attempt} has no job {job}")));
            };
            let status: JobStatus = status.parse().map_err(corrupt)?;
            let Some(c) = counts.get(job) else {
                return Err(corrupt(format!("job {job} has no attempts")));
            };
            let (made, max_number) = (c.made, c.max_number);
            // A terminal job stays as it is; a job already planned in this batch
            // gets one plan only.
            if status.is_terminal() || planned.contains_key(job) {
                planned.entry(*job).or_insert(None);
                continue;
            }
            // Another open attempt (a hedge) carries on. If this failure lifted the
            // job's last unknown, the job runs again, and an attempt whose delivery
            // was turned away while it was blocked is published once more.
            if c.open {
                if status == JobStatus::Unknown && !c.unknown {
                    unblocked.push(*job);
                    for (id, provider) in c.queued.iter().zip(&c.queued_providers) {
                        lifted.push(self.routes.attempt_draft(
                            AttemptId(*id),
                            JobId(*job),
                            provider,
                            None,
                        ));
                    }
                }
                planned.insert(*job, None);
                continue;
            }
            let step = plan(&FailedJob {
                job_id: JobId(*job),
                operation: operation.clone(),
                failed_provider: provider.clone(),
                attempts_made: u32::try_from(made).unwrap_or(u32::MAX),
                error: error.clone(),
                retryable: by_attempt.get(attempt).is_none_or(|f| f.retryable),
                retry_after: by_attempt.get(attempt).and_then(|f| f.retry_after),
            });
            match step {
                NextStep::Retry { provider, delay } => {
                    let id = AttemptId::new();
                    let delay = if immediate { Duration::ZERO } else { delay };
                    let not_before = (!delay.is_zero()).then(|| later(now, delay));
                    next_attempts.push(NextAttempt {
                        id,
                        job: JobId(*job),
                        number: max_number + 1,
                        provider,
                        not_before,
                    });
                    planned.insert(*job, Some(id));
                    triggered.insert(*attempt, id);
                }
                NextStep::GiveUp { error } => {
                    give_up.push((*job, error));
                    planned.insert(*job, None);
                }
            }
        }

        let mut drafts = lifted;
        if !unblocked.is_empty() {
            sqlx::query(
                "UPDATE jobs SET status = 'running', updated_at = now()
                 WHERE id = ANY($1) AND status = 'unknown'",
            )
            .bind(&unblocked)
            .execute(&mut *tx)
            .await?;
        }
        if !next_attempts.is_empty() {
            sqlx::query(
                "WITH new AS (
                     INSERT INTO attempts (id, job_id, number, provider, not_before)
                     SELECT n.id, n.job_id, n.number, n.provider, COALESCE(n.not_before, now())
                     FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[], $5::timestamptz[])
                          AS n(id, job_id, number, provider, not_before)
                     RETURNING job_id
                 )
                 UPDATE jobs j SET status = 'running', updated_at = now()
                 FROM new WHERE j.id = new.job_id AND j.status = 'unknown'",
            )
            .bind(next_attempts.iter().map(|n| n.id.0).collect::<Vec<_>>())
            .bind(next_attempts.iter().map(|n| n.job.0).collect::<Vec<_>>())
            .bind(next_attempts.iter().map(|n| n.number).collect::<Vec<_>>())
            .bind(
                next_attempts
                    .iter()
                    .map(|n| n.provider.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(
                next_attempts
                    .iter()
                    .map(|n| n.not_before)
                    .collect::<Vec<_>>(),
            )
            .execute(&mut *tx)
            .await?;
            for n in &next_attempts {
                drafts.push(
                    self.routes
                        .attempt_draft(n.id, n.job, &n.provider, n.not_before),
                );
            }
        }
        let mut failed_jobs = BTreeSet::new();
        if !give_up.is_empty() {
            let rows = sqlx::query(
                "UPDATE jobs j
                 SET status = 'failed', error = g.error, version = j.version + 1, updated_at = now()
                 FROM unnest($1::uuid[], $2::text[]) AS g(job_id, error)
                 WHERE j.id = g.job_id AND j.status IN ('queued', 'running', 'unknown')
                 RETURNING j.id, j.version, j.owner_id, j.idempotency_key, j.operation, j.status,
                           j.completed_by, j.result, j.error",
            )
            .bind(give_up.iter().map(|g| g.0).collect::<Vec<_>>())
            .bind(give_up.iter().map(|g| g.1.clone()).collect::<Vec<_>>())
            .fetch_all(&mut *tx)
            .await?;
            for row in &rows {
                let ended = Ended::from_row(row)?;
                failed_jobs.insert(ended.job_id);
                drafts.push(ended.draft(&self.routes));
            }
        }
        for (attempt, job, _, _) in &failed {
            outcomes.push((
                AttemptId(*attempt),
                Settled::Failed {
                    next: triggered.get(attempt).copied(),
                    job_failed: failed_jobs.contains(job),
                },
            ));
        }
        Ok((outcomes, drafts))
    }

    /// An operator's out-of-band resolution of an open attempt. `--as failed` is a
    /// definite failure (the route rule picks the next attempt, at once);
    /// `--as cancelled` ends the attempt and its job. Refused on a terminal attempt
    /// or job.
    pub async fn resolve(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<Result<(Settled, Vec<OutboxMessage>), Refusal>> {
        let Some((status, job_id, job_status)) = sqlx::query_as::<_, (String, Uuid, String)>(
            "SELECT a.status, a.job_id, j.status FROM attempts a JOIN jobs j ON j.id = a.job_id WHERE a.id = $1",
        )
        .bind(attempt.0)
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(Err(Refusal::NotFound(format!("attempt {attempt}"))));
        };
        let status: AttemptStatus = status.parse().map_err(corrupt)?;
        let job_status: JobStatus = job_status.parse().map_err(corrupt)?;
        if status.is_terminal() {
            return Ok(Err(Refusal::Terminal(format!(
                "attempt {attempt} is already {status}: a terminal attempt cannot be resolved"
            ))));
        }
        if job_status.is_terminal() {
            return Ok(Err(Refusal::terminal_job(job_id, job_status)));
        }
        let result = match resolution {
            Resolution::Failed => {
                self.retrying(|| async {
                    let mut tx = self.pool.begin().await?;
                    let failure = Failure {
                        attempt_id: attempt,
                        error: "resolved_failed: an operator resolved this attempt as failed"
                            .into(),
                        retryable: true,
                        retry_after: None,
                        usage: None,
                        request_id: None,
                    };
                    let (mut outcomes, drafts) = self
                        .settle_failures(
                            &mut tx,
                            &[failure],
                            &["queued", "started", "unknown"],
                            plan,
                            true,
                        )
                        .await?;
                    let publish = self.insert_outbox(&mut tx, &drafts).await?;
                    tx.commit().await?;
                    Ok(outcomes.pop().map(|(_, s)| (s, publish)))
                })
                .await?
            }
            Resolution::Cancelled => {
                let reason = format!(
                    "cancelled: attempt {attempt} was resolved as cancelled by an operator"
                );
                self.retrying(|| self.cancel_once(JobId(job_id), Some(attempt), &reason))
                    .await?
                    .map(|publish| (Settled::Stale, publish))
            }
        };
        Ok(result.ok_or_else(|| {
            Refusal::Terminal(format!(
                "attempt {attempt} changed while it was being resolved; look again"
            ))
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
    async fn cancel_once(
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

    /// Fails attempts that are still `queued` (their message was lost for good), and
    /// plans what follows each, as for any definite failure.
    pub async fn fail_queued(
        &self,
        attempts: &[(AttemptId, String)],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<(AttemptId, Settled)>, Vec<OutboxMessage>)> {
        if attempts.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        self.retrying(|| async {
            let mut tx = self.pool.begin().await?;
            let failures: Vec<Failure> = attempts
                .iter()
                .map(|(id, error)| Failure {
                    attempt_id: *id,
                    error: error.clone(),
                    retryable: true,
                    retry_after: None,
                    usage: None,
                    request_id: None,
                })
                .collect();
            let (outcomes, drafts) = self
                .settle_failures(&mut tx, &failures, &["queued"], plan, false)
                .await?;
            let publish = self.insert_outbox(&mut tx, &drafts).await?;
            tx.commit().await?;
            Ok((outcomes, publish))
        })
        .await
    }

    /// Queued attempts that never started although their message was published
    /// `stuck_after` ago (it was dead-lettered, or its queue purged): republishes each
    /// (a duplicate is harmless: `queued → started` is guarded) and counts it.
    /// Returns the messages to publish now, and the attempts already republished
    /// `max_republish` times, for the caller to fail.
    ///
    /// Attempts of the providers in `backlogged` are left alone: their queue still
    /// holds messages, so theirs is most likely waiting there behind the others.
    pub async fn stuck_queued(
        &self,
        stuck_after: Duration,
        max_republish: i32,
        backlogged: &[String],
    ) -> Result<(Vec<OutboxMessage>, Vec<AttemptId>)> {
        let mut tx = self.pool.begin().await?;
        let stuck: Vec<(Uuid, Uuid, String, i32)> = sqlx::query_as(
            "SELECT a.id, a.job_id, a.provider, a.republished FROM attempts a
             JOIN jobs j ON j.id = a.job_id
             WHERE a.status = 'queued' AND a.not_before < now() - make_interval(secs => $1)
               AND j.status <> 'unknown' AND a.provider <> ALL($2)
               AND NOT EXISTS (SELECT 1 FROM outbox o
                               WHERE o.message_id = a.id::text AND o.published_at IS NULL)
             ORDER BY a.id
             LIMIT 100
             FOR UPDATE OF a SKIP LOCKED",
        )
        .bind(stuck_after.as_secs_f64())
        .bind(backlogged)
        .fetch_all(&mut *tx)
        .await?;
        let (exhausted, again): (Vec<_>, Vec<_>) =
            stuck.into_iter().partition(|s| s.3 >= max_republish);
        let mut drafts = Vec::new();
        if !again.is_empty() {
            sqlx::query("UPDATE attempts SET republished = republished + 1, not_before = now() WHERE id = ANY($1)")
                .bind(again.iter().map(|s| s.0).collect::<Vec<_>>())
                .execute(&mut *tx)
                .await?;
            for (id, job, provider, n) in &again {
                tracing::warn!(attempt_id = %id, republished = n + 1, "queued attempt never started; republishing its message");
                drafts.push(
                    self.routes
                        .attempt_draft(AttemptId(*id), JobId(*job), provider, None),
                );
            }
        }
        let publish = self.insert_outbox(&mut tx, &drafts).await?;
        tx.commit().await?;
        Ok((
            publish,
            exhausted.into_iter().map(|s| AttemptId(s.0)).collect(),
        ))
    }

    /// Jobs of operations with `hedge_after` whose only attempt has been `started`
    /// longer than that, with no hedge yet: `(job, its provider, operation, attempts
    /// made)`.
    pub async fn hedge_candidates(
        &self,
        hedge_after: &[(String, Duration)],
    ) -> Result<Vec<(JobId, String, String, u32)>> {
        if hedge_after.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<(Uuid, String, String, i64)> = sqlx::query_as(
            "SELECT a.job_id, a.provider, j.operation,
                    (SELECT count(*) FROM attempts x WHERE x.job_id = a.job_id)
             FROM attempts a
             JOIN jobs j ON j.id = a.job_id
             JOIN unnest($1::text[], $2::float8[]) AS h(operation, secs) ON h.operation = j.operation
             WHERE a.status = 'started' AND a.lane = 0 AND j.status = 'running'
               AND a.started_at + make_interval(secs => h.secs) < now()
               AND NOT EXISTS (SELECT 1 FROM attempts b WHERE b.job_id = a.job_id AND b.lane = 1)
             ORDER BY a.started_at
             LIMIT 100",
        )
        .bind(hedge_after.iter().map(|h| h.0.clone()).collect::<Vec<_>>())
        .bind(hedge_after.iter().map(|h| h.1.as_secs_f64()).collect::<Vec<_>>())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(job, provider, op, n)| {
                (
                    JobId(job),
                    provider,
                    op,
                    u32::try_from(n).unwrap_or(u32::MAX),
                )
            })
            .collect())
    }

    /// Takes due outbox rows whose lease is free (or over) for this publisher.
    /// `SKIP LOCKED` lets several relays share the table without waiting.
    pub async fn claim_outbox(&self, limit: i64) -> Result<Vec<OutboxMessage>> {
        let rows = sqlx::query(
            "UPDATE outbox SET lease_until = now() + make_interval(secs => $2)
             WHERE id IN (
                 SELECT id FROM outbox
                 WHERE published_at IS NULL AND not_before <= now()
                   AND (lease_until IS NULL OR lease_until < now())
                 ORDER BY id
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED)
             RETURNING id, exchange, routing_key, message_id, body",
        )
        .bind(limit)
        .bind(self.routes.lease.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(outbox_message).collect()
    }

    /// Deletes up to `limit` outbox rows published more than `retention` ago;
    /// returns how many. Rows not yet published are never touched.
    pub async fn prune_outbox(&self, retention: Duration, limit: i64) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM outbox WHERE id IN (
                 SELECT id FROM outbox
                 WHERE published_at < now() - make_interval(secs => $1)
                 ORDER BY published_at
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED)",
        )
        .bind(retention.as_secs_f64())
        .bind(limit)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Marks outbox rows as published (after the broker confirmed them).
    pub async fn mark_published(&self, ids: &[i64]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "UPDATE outbox SET published_at = now() WHERE id = ANY($1) AND published_at IS NULL",
        )
        .bind(ids)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Started attempts silent past their deadline plus `grace` lost their worker:
    /// they and their jobs become `unknown` (never `failed`: the provider may still
    /// be working). One whose job has already ended blocks nothing: it is
    /// `discarded`, with the reason.
    pub async fn expire_vanished(&self, grace: Duration) -> Result<Vec<AttemptId>> {
        let mut tx = self.pool.begin().await?;
        let vanished: Vec<(Uuid,)> = sqlx::query_as(
            "SELECT id FROM attempts
             WHERE status = 'started' AND deadline_at + make_interval(secs => $1) < now()
             ORDER BY id
             LIMIT 500",
        )
        .bind(grace.as_secs_f64())
        .fetch_all(&mut *tx)
        .await?;
        if vanished.is_empty() {
            return Ok(Vec::new());
        }
        // Decided as for any timeout: under the attempts' and jobs' locks, so a
        // job that ended meanwhile gets a discarded attempt, never an unknown one.
        let error = "worker_vanished: no outcome by the deadline plus the grace period";
        let unknowns: Vec<(AttemptId, String)> = vanished
            .iter()
            .map(|(id,)| (AttemptId(*id), error.to_owned()))
            .collect();
        let marked = mark_unknown(&mut tx, &unknowns).await?;
        tx.commit().await?;
        Ok(marked
            .into_iter()
            .filter(|(_, s)| *s == Settled::Unknown)
            .map(|(id, _)| id)
            .collect())
    }

    /// Prometheus gauges read from the tables: jobs and attempts by status, the
    /// oldest `unknown` attempt's age (alert on it: only a person or late evidence
    /// resolves an unknown), and the outbox backlog.
    pub async fn gauges(&self) -> Result<String> {
        let jobs: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, count(*) FROM jobs GROUP BY status")
                .fetch_all(&self.pool)
                .await?;
        let attempts: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, count(*) FROM attempts GROUP BY status")
                .fetch_all(&self.pool)
                .await?;
        let (oldest_unknown, backlog): (Option<f64>, i64) = sqlx::query_as(
            "SELECT (SELECT extract(epoch FROM now() - min(COALESCE(started_at, created_at)))::float8
                     FROM attempts WHERE status = 'unknown'),
                    (SELECT count(*) FROM outbox WHERE published_at IS NULL)",
        )
        .fetch_one(&self.pool)
        .await?;
        let mut out = String::new();
        out.push_str("# TYPE onejob_jobs gauge\n");
        for s in JobStatus::ALL {
            let n = jobs
                .iter()
                .find(|(k, _)| k == s.as_str())
                .map_or(0, |(_, n)| *n);
            out.push_str(&format!("onejob_jobs{{status=\"{s}\"}} {n}\n"));
        }
        out.push_str("# TYPE onejob_attempts gauge\n");
        for s in AttemptStatus::ALL {
            let n = attempts
                .iter()
                .find(|(k, _)| k == s.as_str())
                .map_or(0, |(_, n)| *n);
            out.push_str(&format!("onejob_attempts{{status=\"{s}\"}} {n}\n"));
        }
        out.push_str("# TYPE onejob_oldest_unknown_attempt_seconds gauge\n");
        out.push_str(&format!(
            "onejob_oldest_unknown_attempt_seconds {}\n",
            oldest_unknown.unwrap_or(0.0)
        ));
        out.push_str("# TYPE onejob_outbox_unpublished gauge\n");
        out.push_str(&format!("onejob_outbox_unpublished {backlog}\n"));
        Ok(out)
    }

    /// Starts a hedge: one parallel attempt on `provider` beside a job's running
    /// attempt. Guarded in one statement under the job's row lock: the job must be
    /// `running` with exactly one open attempt, `started`, in the main lane, and no
    /// attempt `unknown`. Returns the new attempt and its message to publish, or
    /// `None` when the guard refused.
    pub async fn hedge(
        &self,
        job: JobId,
        provider: &str,
    ) -> Result<Option<(AttemptId, Vec<OutboxMessage>)>> {
        let id = AttemptId::new();
        let mut tx = self.pool.begin().await?;
        let locked: Option<(String,)> =
            sqlx::query_as("SELECT status FROM jobs WHERE id = $1 FOR UPDATE")
                .bind(job.0)
                .fetch_optional(&mut *tx)
                .await?;
        if !matches!(locked, Some((ref s,)) if s == "running") {
            return Ok(None);
        }
        let inserted = sqlx::query(
            "INSERT INTO attempts (id, job_id, number, provider, lane)
             SELECT $1, $2, max(number) + 1, $3, 1 FROM attempts WHERE job_id = $2
             HAVING count(*) FILTER (WHERE status IN ('queued', 'unknown')) = 0
                AND count(*) FILTER (WHERE status = 'started' AND lane = 0) = 1
                AND count(*) FILTER (WHERE lane = 1 AND status IN ('queued', 'started', 'unknown')) = 0",
        )
        .bind(id.0)
        .bind(job.0)
        .bind(provider)
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() == 0 {
            return Ok(None);
        }
        let draft = self.routes.attempt_draft(id, job, provider, None);
        let publish = self.insert_outbox(&mut tx, &[draft]).await?;
        tx.commit().await?;
        Ok(Some((id, publish)))
    }

    /// Records a qualification run, one row per case.
    pub async fn record_qualification(&self, q: &crate::domain::Qualification) -> Result<Uuid> {
        let run = Uuid::now_v7();
        // A run with no case still records that it failed.
        let cases: Vec<crate::domain::CaseResult> = if q.cases.is_empty() {
            vec![crate::domain::CaseResult {
                index: 0,
                passed: false,
                detail: "no_cases: the operation has no golden cases to qualify with".into(),
                prompt_tokens: None,
                tokens_estimated: false,
                latency_ms: None,
            }]
        } else {
            q.cases.clone()
        };
        sqlx::query(
            "INSERT INTO provider_qualifications
                 (run_id, provider, operation, contract_hash, case_index, passed, detail,
                  prompt_tokens, tokens_estimated, latency_ms)
             SELECT $1, $2, $3, $4, c.case_index, c.passed, c.detail, c.prompt_tokens, c.estimated, c.latency_ms
             FROM unnest($5::int[], $6::bool[], $7::text[], $8::int[], $9::bool[], $10::bigint[])
                  AS c(case_index, passed, detail, prompt_tokens, estimated, latency_ms)",
        )
        .bind(run)
        .bind(&q.provider)
        .bind(&q.operation)
        .bind(&q.contract_hash)
        .bind(cases.iter().map(|c| i32::try_from(c.index).unwrap_or(i32::MAX)).collect::<Vec<_>>())
        .bind(cases.iter().map(|c| c.passed).collect::<Vec<_>>())
        .bind(cases.iter().map(|c| c.detail.clone()).collect::<Vec<_>>())
        .bind(
            cases
                .iter()
                .map(|c| c.prompt_tokens.map(|t| i32::try_from(t).unwrap_or(i32::MAX)))
                .collect::<Vec<_>>(),
        )
        .bind(cases.iter().map(|c| c.tokens_estimated).collect::<Vec<_>>())
        .bind(
            cases
                .iter()
                .map(|c| c.latency_ms.map(|l| i64::try_from(l).unwrap_or(i64::MAX)))
                .collect::<Vec<_>>(),
        )
        .execute(&self.pool)
        .await?;
        Ok(run)
    }

    /// For each `(provider, operation)`, the contract hash of its latest
    /// qualification run and whether every case of that run passed.
    pub async fn latest_qualifications(
        &self,
        pairs: &[(String, String, String)],
    ) -> Result<HashMap<(String, String), (String, bool)>> {
        if pairs.is_empty() {
            return Ok(HashMap::new());
        }
        let rows: Vec<(String, String, String, bool)> = sqlx::query_as(
            "WITH latest AS (
                 SELECT DISTINCT ON (q.provider, q.operation) q.provider, q.operation, q.run_id, q.contract_hash
                 FROM provider_qualifications q
                 JOIN unnest($1::text[], $2::text[]) AS k(provider, operation)
                   ON q.provider = k.provider AND q.operation = k.operation
                 ORDER BY q.provider, q.operation, q.created_at DESC, q.id DESC
             )
             SELECT l.provider, l.operation, l.contract_hash, bool_and(q.passed)
             FROM latest l JOIN provider_qualifications q ON q.run_id = l.run_id
             GROUP BY l.provider, l.operation, l.contract_hash",
        )
        .bind(pairs.iter().map(|p| p.0.clone()).collect::<Vec<_>>())
        .bind(pairs.iter().map(|p| p.1.clone()).collect::<Vec<_>>())
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(p, o, h, ok)| ((p, o), (h, ok)))
            .collect())
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

    /// Records a new gateway token for `owner_id` (only its digest) and returns
    /// the token's id.
    pub async fn create_token(&self, owner_id: &str, token: &Token) -> Result<Uuid> {
        let id = Uuid::now_v7();
        sqlx::query("INSERT INTO gateway_tokens (id, owner_id, token_sha256) VALUES ($1, $2, $3)")
            .bind(id)
            .bind(owner_id)
            .bind(token.digest())
            .execute(&self.pool)
            .await?;
        Ok(id)
    }

    /// The owner a presented token belongs to, unless it is unknown or revoked.
    pub async fn token_owner(&self, token: &Token) -> Result<Option<String>> {
        let row: Option<(String,)> = sqlx::query_as(
            "SELECT owner_id FROM gateway_tokens WHERE token_sha256 = $1 AND revoked_at IS NULL",
        )
        .bind(token.digest())
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|(owner,)| owner))
    }

    /// Gateway tokens, oldest first, optionally of one owner. Never the tokens
    /// themselves: the database does not have them.
    pub async fn tokens(&self, owner_id: Option<&str>) -> Result<Vec<TokenView>> {
        let rows = sqlx::query(
            "SELECT id, owner_id, created_at, revoked_at FROM gateway_tokens
             WHERE $1::text IS NULL OR owner_id = $1
             ORDER BY created_at, id",
        )
        .bind(owner_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(token_view).collect()
    }

    /// Revokes a token at once: the gateway refuses it from its next request on.
    /// Returns the token and whether it had already been revoked (revoking twice
    /// keeps the first time); `Ok(None)` when there is no such token.
    pub async fn revoke_token(&self, id: Uuid) -> Result<Option<(TokenView, bool)>> {
        let row = sqlx::query(
            "UPDATE gateway_tokens t SET revoked_at = coalesce(b.revoked_at, now())
             FROM (SELECT id, revoked_at FROM gateway_tokens WHERE id = $1 FOR UPDATE) b
             WHERE t.id = b.id
             RETURNING t.id, t.owner_id, t.created_at, t.revoked_at,
                       b.revoked_at IS NOT NULL AS already",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| Ok((token_view(&r)?, r.try_get("already")?)))
            .transpose()
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
}

/// An attempt planned after a definite failure. `not_before` is `None` when it is
/// due now: its writer publishes it at once instead of leaving it to the relay.
struct NextAttempt {
    id: AttemptId,
    job: JobId,
    number: i32,
    provider: String,
    not_before: Option<DateTime<Utc>>,
}

/// What `settle_failures` needs to know of a job's attempts.
#[derive(sqlx::FromRow)]
struct AttemptCounts {
    job_id: Uuid,
    made: i64,
    max_number: i32,
    /// Some attempt is `queued`, `started` or `unknown`.
    open: bool,
    /// Some attempt is `unknown`.
    unknown: bool,
    /// The `queued` attempts, and their providers.
    queued: Vec<Uuid>,
    queued_providers: Vec<String>,
}

/// One definite failure to settle.
struct Failure {
    attempt_id: AttemptId,
    error: String,
    retryable: bool,
    retry_after: Option<Duration>,
    usage: Option<Value>,
    request_id: Option<String>,
}

/// Timeouts: each still-`started` attempt becomes `unknown` and blocks its job,
/// unless the job has already ended (another attempt won, or it was cancelled):
/// then nothing is blocked any more, and the attempt is `discarded` with the
/// reason. Attempts are locked first, then their jobs, as everywhere.
async fn mark_unknown(
    tx: &mut PgConnection,
    unknowns: &[(AttemptId, String)],
) -> Result<HashMap<AttemptId, Settled>> {
    let locked: Vec<(Uuid, Uuid)> = sqlx::query_as(
        "SELECT id, job_id FROM attempts WHERE id = ANY($1) AND status = 'started'
         ORDER BY id FOR UPDATE",
    )
    .bind(unknowns.iter().map(|u| u.0.0).collect::<Vec<_>>())
    .fetch_all(&mut *tx)
    .await?;
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
    let jobs: HashMap<Uuid, (String, Option<Uuid>)> =
        sqlx::query_as::<_, (Uuid, String, Option<Uuid>)>(
            "SELECT id, status, completed_by FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE",
        )
        .bind(&job_ids)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|(id, status, winner)| (id, (status, winner)))
        .collect();
    let errors: HashMap<AttemptId, &str> =
        unknowns.iter().map(|(id, e)| (*id, e.as_str())).collect();
    let mut outcomes = HashMap::new();
    let (mut ids, mut statuses, mut texts) = (Vec::new(), Vec::new(), Vec::new());
    for (attempt, job) in &locked {
        let attempt = AttemptId(*attempt);
        let error = errors.get(&attempt).copied().unwrap_or_default();
        let (status, winner) = jobs
            .get(job)
            .ok_or_else(|| corrupt(format!("attempt {attempt} has no job {job}")))?;
        let ended = status.parse::<JobStatus>().map_err(corrupt)?.is_terminal();
        ids.push(attempt.0);
        if ended {
            statuses.push(AttemptStatus::Discarded.as_str());
            texts.push(format!("discarded: {error} (after its job had ended)"));
            outcomes.insert(
                attempt,
                Settled::Discarded {
                    winner: winner.map(AttemptId),
                },
            );
        } else {
            statuses.push(AttemptStatus::Unknown.as_str());
            texts.push(error.to_owned());
            outcomes.insert(attempt, Settled::Unknown);
        }
    }
    sqlx::query(
        "WITH marked AS (
             UPDATE attempts a
             SET status = i.status, error = i.error,
                 finished_at = CASE WHEN i.status = 'discarded' THEN now() END
             FROM unnest($1::uuid[], $2::text[], $3::text[]) AS i(attempt_id, status, error)
             WHERE a.id = i.attempt_id
             RETURNING a.job_id, a.status
         )
         UPDATE jobs j SET status = 'unknown', updated_at = now()
         FROM (SELECT DISTINCT job_id FROM marked WHERE status = 'unknown') m
         WHERE j.id = m.job_id AND j.status = 'running'",
    )
    .bind(&ids)
    .bind(&statuses)
    .bind(&texts)
    .execute(&mut *tx)
    .await?;
    Ok(outcomes)
}

/// `now + delay`, saturating instead of panicking: a delay comes from outside
/// (a provider's `Retry-After`, configuration) and must never crash a worker.
fn later(now: DateTime<Utc>, delay: Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(delay)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

fn token_view(row: &sqlx::postgres::PgRow) -> Result<TokenView> {
    Ok(TokenView {
        id: row.try_get("id")?,
        owner_id: row.try_get("owner_id")?,
        created_at: row.try_get("created_at")?,
        revoked_at: row.try_get("revoked_at")?,
    })
}

fn outbox_message(row: &sqlx::postgres::PgRow) -> Result<OutboxMessage> {
    Ok(OutboxMessage {
        id: row.try_get("id")?,
        exchange: row.try_get("exchange")?,
        routing_key: row.try_get("routing_key")?,
        message_id: row.try_get("message_id")?,
        body: row.try_get("body")?,
    })
}
