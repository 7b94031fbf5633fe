//! An operator's out-of-band resolution of an open attempt: a definite
//! failure, or the end of the attempt and its job.

use crate::edges::store::handles::Settle;
use crate::policy::next::{FailedJob, NextStep};
use uuid::Uuid;

use crate::domain::{AttemptId, AttemptStatus, JobId};
use crate::edges::store::audit;
use crate::edges::store::audit::{Action, Actor};
use crate::edges::store::drafts::OutboxMessage;
use crate::edges::store::error::{Refusal, Result};
use crate::edges::store::settle::{Failure, Resolution, Settled};

/// What a resolution did: the attempt's settlement and the outbox rows to
/// publish now; `None` when its last try changed nothing.
type Resolved = Option<(Settled, Vec<OutboxMessage>)>;

impl Settle<'_> {
    /// An operator's out-of-band resolution of an open attempt. `--as failed` is a
    /// definite failure (the route rule picks the next attempt, at once);
    /// `--as cancelled` ends the attempt and its job. Refused on a terminal attempt
    /// or job.
    pub async fn resolve(
        self,
        attempt: AttemptId,
        resolution: Resolution,
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
        actor: &Actor,
    ) -> Result<Result<(Settled, Vec<OutboxMessage>), Refusal>> {
        let Some((job_id, status, job_status)) = self.0.jobs().attempt_state(attempt).await? else {
            return Ok(Err(Refusal::NotFound(format!("attempt {attempt}"))));
        };
        if status.is_terminal() {
            return Ok(Err(Refusal::Terminal(format!(
                "attempt {attempt} is already {status}: a terminal attempt cannot be resolved"
            ))));
        }
        if job_status.is_terminal() {
            return Ok(Err(Refusal::terminal_job(job_id, job_status)));
        }
        // The audit row's id is chosen here, once for every try: a try whose
        // commit reply was lost is found done by its row.
        let audit_id = Uuid::now_v7();
        let result = match resolution {
            Resolution::Failed => {
                self.resolve_failed(attempt, job_id, plan, actor, audit_id)
                    .await?
            }
            Resolution::Cancelled => {
                self.resolve_cancelled(attempt, job_id, actor, audit_id)
                    .await?
            }
        };
        if let Some(done) = result {
            return Ok(Ok(done));
        }
        // Nothing changed on the last try: the attempt changed meanwhile, or an
        // earlier try committed although its reply was lost. Its audit row
        // tells which; its outbox rows are the relay's to publish.
        self.resolved_unseen(attempt, resolution, audit_id).await
    }

    /// `--as failed`: the attempt fails definitely, whatever its open status,
    /// and what follows is planned at once; the audit row names the next
    /// attempt.
    async fn resolve_failed(
        self,
        attempt: AttemptId,
        job_id: JobId,
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
        actor: &Actor,
        audit_id: Uuid,
    ) -> Result<Resolved> {
        self.0
            .retrying(|| async {
                let mut tx = self.0.pool.begin().await?;
                let failure = Failure {
                    attempt_id: attempt,
                    error: "resolved_failed: an operator resolved this attempt as failed".into(),
                    retryable: true,
                    retry_after: None,
                    usage: None,
                    request_id: None,
                };
                let (mut outcomes, drafts) = self
                    .settle_failures(
                        &mut tx,
                        &[failure],
                        &[
                            AttemptStatus::Queued,
                            AttemptStatus::Started,
                            AttemptStatus::Unknown,
                        ],
                        plan,
                        true,
                        false,
                    )
                    .await?;
                let Some((_, settled)) = outcomes.pop() else {
                    return Ok(None);
                };
                let next = match settled {
                    Settled::Failed { next, .. } => next,
                    _ => None,
                };
                let action = Action {
                    id: Some(audit_id),
                    action: "attempt.resolve_failed",
                    job: Some(job_id),
                    attempt: Some(attempt),
                    detail: serde_json::json!({ "next_attempt": next }),
                    ..Action::default()
                };
                audit::record(&mut tx, actor, &action).await?;
                let publish = self.0.outbox().insert(&mut tx, &drafts).await?;
                tx.commit().await?;
                Ok(Some((settled, publish)))
            })
            .await
    }

    /// `--as cancelled`: the attempt ends, and its job is cancelled with it.
    async fn resolve_cancelled(
        self,
        attempt: AttemptId,
        job_id: JobId,
        actor: &Actor,
        audit_id: Uuid,
    ) -> Result<Resolved> {
        let reason =
            format!("cancelled: attempt {attempt} was resolved as cancelled by an operator");
        let action = Action {
            id: Some(audit_id),
            action: "attempt.resolve_cancelled",
            job: Some(job_id),
            attempt: Some(attempt),
            ..Action::default()
        };
        Ok(self
            .0
            .retrying(|| {
                self.0
                    .jobs()
                    .cancel_once(job_id, Some(attempt), &reason, (actor, &action))
            })
            .await?
            .map(|publish| (Settled::Stale, publish)))
    }

    /// A resolution whose last try changed nothing: done by an earlier try
    /// whose reply was lost (its audit row says so, and what it did), or
    /// refused, the attempt having changed meanwhile.
    async fn resolved_unseen(
        self,
        attempt: AttemptId,
        resolution: Resolution,
        audit_id: Uuid,
    ) -> Result<Result<(Settled, Vec<OutboxMessage>), Refusal>> {
        match self.0.audit().recorded(audit_id).await? {
            Some(detail) => {
                let settled = match resolution {
                    Resolution::Failed => Settled::Failed {
                        next: serde_json::from_value(detail["next_attempt"].clone())
                            .unwrap_or_default(),
                        job_failed: false,
                    },
                    Resolution::Cancelled => Settled::Stale,
                };
                Ok(Ok((settled, Vec::new())))
            }
            None => Ok(Err(Refusal::Terminal(format!(
                "attempt {attempt} changed while it was being resolved; look again"
            )))),
        }
    }
}
