//! All SQL lives here, one file per aggregate: `jobs` (admission, views,
//! cancellation), `settle` (starting and settling attempts), `outbox`, `sweeps`
//! (what the reconciler asks), `tokens`, `qualifications` and `gauges`; this file
//! holds the types they share, the connection and the retry of transient errors.
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
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use crate::intent::{Fingerprint, Intent};
use crate::token::Token;

/// The migrations, embedded in every binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

mod audit;
mod console;
mod gauges;
mod jobs;
mod kept;
mod outbox;
mod qualifications;
mod retention;
mod settle;
mod sweeps;
mod tokens;

pub use audit::{Action, Actor, AuditEntry};
pub use console::{JobFilter, JobLine, JobMessage, Overview, Session, Unknown};
pub use qualifications::QualificationRun;
pub use retention::{Pass, Policy, Pruned};
pub use tokens::OperatorTokenView;

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
    /// The URL's login was cut short ([`crate::broker::login_cut_short`]):
    /// refused before the driver reads it.
    #[error("the database URL has {}", crate::broker::CUT_SHORT)]
    CutShort,
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

    /// Contention over rows, not a fault of the data nor of the server: a lock
    /// that could not be had in time (55P03, under a `lock_timeout`), a statement
    /// cancelled by `statement_timeout` (57014), a deadlock (40P01) or a
    /// serialization failure (40001). It costs the statement that met it a later
    /// try, never the work batched beside it.
    pub fn is_contention(&self) -> bool {
        matches!(self, StoreError::Db(sqlx::Error::Database(db))
            if matches!(db.code().as_deref(), Some("55P03" | "57014" | "40P01" | "40001")))
    }

    /// The connection broke or none could be had: the statement may or may not
    /// have taken effect, so only a statement that is safe to run twice is run
    /// again on it.
    fn is_connection_lost(&self) -> bool {
        matches!(
            self,
            StoreError::Db(sqlx::Error::PoolTimedOut | sqlx::Error::Io(_))
                | StoreError::Migrate(sqlx::migrate::MigrateError::Execute(
                    sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)
                ))
        )
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
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
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
    /// Postgres refused to store this settlement (its data, not an outage):
    /// nothing of it was written, and the settlements batched with it were
    /// written without it.
    Refused {
        /// Postgres's reason.
        error: String,
    },
    /// Its job or attempt row was held under someone else's lock (or the
    /// database timed the settlement out): nothing of it was written, the
    /// settlements batched with it were written without it, and it is to be
    /// settled again later, never dropped.
    Busy,
}

/// What one claim statement did with the attempts it was given.
#[derive(Clone, Debug, Default)]
pub struct Claim {
    /// The attempts it moved `queued → started` (or had moved, when the same
    /// claim runs again after its reply was lost).
    pub started: Vec<Started>,
    /// Queued attempts whose job row was held under someone else's lock: not
    /// started, to be claimed again later.
    pub busy: Vec<AttemptId>,
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

/// A `jobs` row, as the view queries read it; [`JobRow::with`] adds its attempts.
struct JobRow {
    id: JobId,
    owner_id: String,
    idempotency_key: String,
    request_fingerprint: String,
    operation: String,
    input: Value,
    provider: Option<String>,
    status: JobStatus,
    version: i64,
    completed_by: Option<AttemptId>,
    result: Option<Value>,
    error: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl JobRow {
    fn with(self, attempts: Vec<AttemptView>) -> JobView {
        JobView {
            id: self.id,
            owner_id: self.owner_id,
            idempotency_key: self.idempotency_key,
            request_fingerprint: self.request_fingerprint,
            operation: self.operation,
            input: self.input,
            provider: self.provider,
            status: self.status,
            version: self.version,
            completed_by: self.completed_by,
            result: self.result,
            error: self.error,
            created_at: self.created_at,
            updated_at: self.updated_at,
            attempts,
        }
    }
}

/// A job the reconciler may hedge: its only attempt has run past `hedge_after`.
#[derive(Clone, Debug, PartialEq)]
pub struct HedgeCandidate {
    /// The job.
    pub job_id: JobId,
    /// The provider of its running attempt.
    pub provider: String,
    /// Its operation.
    pub operation: String,
    /// How many attempts it has made.
    pub attempts_made: u32,
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
    /// Its stable code and onejob's own message
    /// ([`crate::domain::public_error`]): an event goes to every subscriber,
    /// and a provider's error text (which may quote keys or tenant data) is
    /// for operators only.
    error: Option<String>,
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
    job_id: JobId,
    version: i64,
    owner_id: String,
    idempotency_key: String,
    operation: String,
    status: JobStatus,
    completed_by: Option<AttemptId>,
    result: Option<Value>,
    error: Option<String>,
}

impl Ended {
    fn draft(&self, routes: &Routes) -> OutboxDraft {
        let kind = match self.status {
            JobStatus::Succeeded => "job.succeeded",
            JobStatus::Failed => "job.failed",
            // Only the three terminal states end a job; the statements that
            // return an `Ended` set one of them.
            _ => "job.cancelled",
        };
        routes.event_draft(&JobEvent {
            event_id: format!("{}:{}", self.job_id, self.version),
            kind,
            job_id: self.job_id,
            version: self.version,
            owner_id: &self.owner_id,
            idempotency_key: &self.idempotency_key,
            operation: &self.operation,
            status: self.status.as_str(),
            completed_by: self.completed_by,
            result: self.result.as_ref(),
            error: self.error.as_deref().map(|stored| {
                let (code, message) = crate::domain::public_error(stored);
                format!("{code}: {message}")
            }),
            occurred_at: Utc::now(),
        })
    }
}

/// What every onejob session sets at its start: no transaction idles for
/// more than a minute, and a silent peer is probed after 30 s (then every
/// 10 s, three times) so that the server ends a half-open session and frees
/// its locks.
const SESSION_SETTINGS: [(&str, &str); 4] = [
    ("idle_in_transaction_session_timeout", "60s"),
    ("tcp_keepalives_idle", "30"),
    ("tcp_keepalives_interval", "10"),
    ("tcp_keepalives_count", "3"),
];

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
        // A session that stops talking must not hold rows forever: the
        // server ends a transaction left idle (a client that froze or lost its
        // way mid-transaction) and probes a silent client's socket, so that a
        // half-open connection's locks are released within a minute or two.
        // A setting the URL's own `options` names is left as the URL says.
        if crate::broker::login_cut_short(url) {
            return Err(StoreError::CutShort);
        }
        let options: PgConnectOptions = url.parse()?;
        let named = options.get_options().unwrap_or_default().to_owned();
        let options = options.options(
            SESSION_SETTINGS
                .into_iter()
                .filter(|(name, _)| !named.contains(&format!("{name}="))),
        );
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
        // No ping before each acquire: that would be a round trip per statement.
        // A connection that broke meanwhile fails its statement, the pool drops
        // it, and the callers' retries take a fresh one.
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .test_before_acquire(false)
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
        if crate::broker::login_cut_short(url) {
            return Err(StoreError::CutShort);
        }
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
        sqlx::query!("SELECT 1 AS one")
            .fetch_one(&self.pool)
            .await
            .is_ok()
    }

    /// The pool, for health checks.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations. sqlx holds an advisory lock meanwhile, so
    /// concurrent pods starting together are safe. A connection lost on the
    /// way (even after a migration committed unseen) runs it again: applied
    /// migrations are recorded, the lock dies with its session, and what is
    /// left is applied by the next try.
    pub async fn migrate(&self) -> Result<()> {
        self.retrying_when(
            || async { Ok(MIGRATOR.run(&self.pool).await?) },
            StoreError::is_connection_lost,
        )
        .await
    }

    /// Runs `f` again when it fails with a deadlock or serialization failure,
    /// or its connection broke: for statements that are safe to run twice.
    async fn retrying<T, F, Fut>(&self, f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.retrying_when(f, StoreError::is_transient).await
    }

    /// Runs `f` again when `when` says its failure is worth another try.
    async fn retrying_when<T, F, Fut>(&self, f: F, when: fn(&StoreError) -> bool) -> Result<T>
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
        .when(when)
        .notify(|e, d| {
            crate::metrics::db_retry(&e.retry_code());
            tracing::debug!(error = %e, retry_in = ?d, "transient database error; retrying")
        })
        .await
    }
}

/// `now + delay`, saturating instead of panicking: a delay comes from outside
/// (a provider's `Retry-After`, configuration) and must never crash a worker.
fn later(now: DateTime<Utc>, delay: Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(delay)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}
