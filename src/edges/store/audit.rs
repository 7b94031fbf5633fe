//! The audit table: who did what to which job, when, and why.

use crate::edges::store::handles::Audit;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::domain::{AttemptId, JobId};
use crate::edges::store::error::Result;

/// Who acts, and why: what an operator action is recorded with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Actor {
    /// `operator:NAME` from the console, `cli:USER` from the CLI.
    pub name: String,
    /// Why, as the operator gave it (may be empty from the CLI).
    pub reason: String,
}

impl Actor {
    /// An operator signed in to the console.
    pub fn operator(name: &str, reason: &str) -> Actor {
        Actor {
            name: format!("operator:{name}"),
            reason: reason.to_owned(),
        }
    }

    /// The reconciler's evidence pass: a resolution taken from what the
    /// provider kept.
    pub fn evidence() -> Actor {
        Actor {
            name: "evidence".into(),
            reason: String::new(),
        }
    }

    /// Someone at the CLI, by their login name (`$USER`, else `unknown`).
    pub fn cli(reason: Option<&str>) -> Actor {
        let user = std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "unknown".into());
        Actor {
            name: format!("cli:{user}"),
            reason: reason.unwrap_or_default().to_owned(),
        }
    }
}

/// One action to record.
#[derive(Clone, Debug, Default)]
pub struct Action<'a> {
    /// The audit row's id, when the caller chose it: an action whose commit
    /// reply was lost is then known done by finding its row
    /// (`Audit::recorded`). A new id for each row otherwise.
    pub id: Option<Uuid>,
    /// What was done: `attempt.resolve_failed`, `attempt.resolve_cancelled`,
    /// `job.cancel`, `dlq.replay`, `dlq.purge`, `provider.qualify`.
    pub action: &'a str,
    /// The job it touched, if one.
    pub job: Option<JobId>,
    /// The attempt it touched, if one.
    pub attempt: Option<AttemptId>,
    /// Anything else it touched (a queue, a message id, a provider).
    pub target: Option<String>,
    /// What came of it.
    pub detail: Value,
}

/// An audit row.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AuditEntry {
    /// The row's id.
    pub id: Uuid,
    /// When.
    pub at: DateTime<Utc>,
    /// Who ([`Actor::name`]).
    pub actor: String,
    /// What ([`Action::action`]).
    pub action: String,
    /// The job it touched.
    pub job_id: Option<Uuid>,
    /// The attempt it touched.
    pub attempt_id: Option<Uuid>,
    /// Anything else it touched.
    pub target: Option<String>,
    /// Why.
    pub reason: String,
    /// What came of it.
    pub detail: Value,
}

/// Records an action inside the transaction that does it, so the two commit
/// together.
pub(super) async fn record(
    tx: &mut PgConnection,
    actor: &Actor,
    action: &Action<'_>,
) -> Result<Uuid> {
    let id = action.id.unwrap_or_else(Uuid::now_v7);
    let detail = if action.detail.is_null() {
        Value::Object(Default::default())
    } else {
        action.detail.clone()
    };
    sqlx::query!(
        "INSERT INTO audit (id, actor, action, job_id, attempt_id, target, reason, detail)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        id,
        actor.name,
        action.action,
        action.job.map(|j| j.0) as Option<Uuid>,
        action.attempt.map(|a| a.0) as Option<Uuid>,
        action.target,
        actor.reason,
        detail
    )
    .execute(tx)
    .await?;
    Ok(id)
}

impl Audit<'_> {
    /// The detail of the audit row `id`, if it was written: after a lost
    /// commit reply, whether the action it records took effect.
    pub(super) async fn recorded(self, id: Uuid) -> Result<Option<Value>> {
        Ok(
            sqlx::query_scalar!("SELECT detail FROM audit WHERE id = $1", id)
                .fetch_optional(&self.0.pool)
                .await?,
        )
    }

    /// Records an action on something outside the database (a dead-letter
    /// replay or purge) *before* it is done, so that no such action goes
    /// unrecorded: its detail says `"outcome": "pending"` until
    /// [`Audit::outcome`](crate::edges::store::Audit::outcome) fills in what came of it. A row left pending
    /// is an action whose outcome was never written (the process or the
    /// database failed mid-way): look at the queue.
    pub async fn begin(self, actor: &Actor, action: &Action<'_>) -> Result<Uuid> {
        let mut action = action.clone();
        let mut detail = match action.detail {
            Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        detail.insert("outcome".into(), Value::from("pending"));
        action.detail = Value::Object(detail);
        let mut conn = self.0.pool.acquire().await?;
        record(&mut conn, actor, &action).await
    }

    /// Fills in what came of an action recorded by [`Audit::begin`](crate::edges::store::Audit::begin):
    /// `outcome` (`failed`, or else `done`) and the rest of `detail`, merged
    /// into the row's detail.
    pub async fn outcome(self, id: Uuid, failed: bool, detail: &Value) -> Result<()> {
        let mut merged = match detail {
            Value::Object(map) => map.clone(),
            _ => serde_json::Map::new(),
        };
        let outcome = if failed { "failed" } else { "done" };
        merged.insert("outcome".into(), Value::from(outcome));
        sqlx::query!(
            "UPDATE audit SET detail = detail || $2 WHERE id = $1",
            id,
            Value::Object(merged)
        )
        .execute(&self.0.pool)
        .await?;
        Ok(())
    }

    /// The audit rows of a job, oldest first.
    pub async fn of_job(self, job: JobId) -> Result<Vec<AuditEntry>> {
        Ok(sqlx::query_as!(
            AuditEntry,
            "SELECT id, at, actor, action, job_id, attempt_id, target, reason, detail
             FROM audit WHERE job_id = $1 ORDER BY at, id",
            job.0
        )
        .fetch_all(&self.0.pool)
        .await?)
    }

    /// One audit row, by its id.
    pub async fn entry(self, id: Uuid) -> Result<Option<AuditEntry>> {
        Ok(sqlx::query_as!(
            AuditEntry,
            "SELECT id, at, actor, action, job_id, attempt_id, target, reason, detail
             FROM audit WHERE id = $1",
            id
        )
        .fetch_optional(&self.0.pool)
        .await?)
    }

    /// The latest audit rows, newest first.
    pub async fn recent(self, limit: i64) -> Result<Vec<AuditEntry>> {
        Ok(sqlx::query_as!(
            AuditEntry,
            "SELECT id, at, actor, action, job_id, attempt_id, target, reason, detail
             FROM audit ORDER BY at DESC, id DESC LIMIT $1",
            limit
        )
        .fetch_all(&self.0.pool)
        .await?)
    }
}
