//! The guarded start: queued attempts claimed for a call, their jobs marked
//! `running`, and a claim handed back when its caller gave up on it.

use crate::edges::store::handles::Settle;
use std::time::Duration;

use futures_util::TryFutureExt;
use serde_json::Value;
use uuid::Uuid;

use crate::domain::{AttemptId, JobId};
use crate::edges::store::error::{Result, StoreError, corrupt};
use crate::edges::store::settle::{Claim, Started, Unreserved};

impl Settle<'_> {
    /// Moves queued attempts to `started` with one guarded statement and marks their
    /// jobs `running`, under a claim of its own ([`Settle::claim`](crate::edges::store::Settle::claim)). An id missing
    /// from the result was a duplicate delivery (the attempt had already left
    /// `queued`), belongs to a job that has ended, to a job blocked by an
    /// `unknown` attempt ([`Jobs::attempt_state`](crate::edges::store::Jobs::attempt_state) tells which), or to a job row
    /// held under someone else's lock.
    pub async fn start(
        self,
        provider: &str,
        ids: &[AttemptId],
        timeout: Duration,
    ) -> Result<Vec<Started>> {
        Ok(self
            .claim(provider, "none", ids, timeout, Uuid::new_v4())
            .await?
            .started)
    }

    /// Moves queued attempts to `started` with one guarded statement and marks
    /// their jobs `running`; `token` names this claim on the rows it starts,
    /// and `evidence` is what evidence the calls about to be made can have
    /// (the provider's kind: `stored`, `idempotency_key` or `none`), recorded
    /// on each attempt so that evidence is concluded only from calls that
    /// asked for it.
    ///
    /// The same claim run again returns the attempts it has already started:
    /// a claim whose commit took effect although its reply was lost (the
    /// connection broke after the server ran it) is retried with the same
    /// token and finds its attempts its own, so the calls go ahead. Without the
    /// token such attempts would look like another worker's, be dropped as
    /// duplicates, and stay `started` with no call. They are returned without
    /// locking their jobs again: a job row held by someone else meanwhile must
    /// not turn them `busy`, since the next claim (under a new token) would
    /// take them for another worker's.
    ///
    /// The jobs are locked first and their status checked under the lock, so a
    /// timeout that commits meanwhile is seen: a job that just became `unknown` is
    /// never written back to `running`, and no attempt of it starts. A job row
    /// held under someone else's lock is skipped, not waited for: its attempts
    /// come back in [`Claim::busy`], and the rest of the claim goes ahead.
    ///
    /// Attempts are found by primary key. A status test that implies the
    /// predicate of the partial index `attempts_one_open_per_lane` is written
    /// `(…) IS TRUE` (the same filter, which the planner cannot match to the
    /// predicate): otherwise the planner, seeing few open attempts, scans that
    /// whole index, whose entries for attempts that closed a moment ago are
    /// dead until vacuum, and under load those dead entries cost more than the
    /// rest of the statement.
    pub async fn claim(
        self,
        provider: &str,
        evidence: &str,
        ids: &[AttemptId],
        timeout: Duration,
        token: Uuid,
    ) -> Result<Claim> {
        if ids.is_empty() {
            return Ok(Claim::default());
        }
        let ids: Vec<Uuid> = ids.iter().map(|a| a.0).collect();
        let rows = self
            .0
            .retrying(|| {
                sqlx::query_file_as!(
                    ClaimRow,
                    "src/edges/store/settle/claim.sql",
                    &ids,
                    provider,
                    timeout.as_secs_f64(),
                    token,
                    evidence,
                    self.0.routes.owners.daily_tokens,
                )
                .fetch_all(&self.0.per_job)
                .map_err(StoreError::from)
            })
            .await?;
        claim_of(rows, token)
    }

    /// Hands back what the claim `token` started: its attempts go back to
    /// `queued`, for their redelivered messages to claim again. For a claim
    /// whose caller gave up without knowing whether it took effect: an attempt
    /// it did start would otherwise stay `started` with no call, until the
    /// vanished sweep made it `unknown`. Returns how many it handed back.
    pub async fn unclaim(self, token: Uuid) -> Result<u64> {
        self.0
            .retrying(|| async {
                let back = sqlx::query!(
                    "UPDATE attempts SET status = 'queued', claim = NULL, started_at = NULL,
                     deadline_at = NULL
                 WHERE claim = $1 AND status = 'started'",
                    token
                )
                .execute(&self.0.pool)
                .await?;
                Ok(back.rows_affected())
            })
            .await
    }
}

impl Settle<'_> {
    /// Hands back one attempt the claim `token` started, whose call was never
    /// made (its handler was cut off): `queued` again, for its redelivered
    /// message. False when it is not `started` under that claim any more.
    pub async fn unclaim_attempt(self, attempt: AttemptId, token: Uuid) -> Result<bool> {
        self.0
            .retrying(|| async {
                let back = sqlx::query!(
                    "UPDATE attempts SET status = 'queued', claim = NULL, started_at = NULL,
                     deadline_at = NULL
                 WHERE id = $1 AND claim = $2 AND status = 'started'",
                    attempt.0,
                    token
                )
                .execute(&self.0.pool)
                .await?;
                Ok(back.rows_affected() == 1)
            })
            .await
    }
}

/// A row of [`Settle::claim`](crate::edges::store::Settle::claim): an attempt that left `queued`, with its job
/// (`started`), a queued attempt whose job row was held (`busy`), or one that
/// must reserve of its owner's budget before it starts (`unreserved`).
struct ClaimRow {
    attempt_id: AttemptId,
    job_id: JobId,
    number: i32,
    version: i64,
    operation: String,
    input: Value,
    owner_id: String,
    kind: String,
}

/// What a claim's rows say: the attempts it started, each with its job's
/// operation and input, and the attempts whose job row was held.
fn claim_of(rows: Vec<ClaimRow>, token: Uuid) -> Result<Claim> {
    let mut claim = Claim::default();
    for r in rows {
        if r.kind == "busy" {
            claim.busy.push(r.attempt_id);
            continue;
        }
        let input = match r.input {
            Value::Object(m) => m,
            other => return Err(corrupt(format!("job input is not an object: {other}"))),
        };
        if r.kind == "unreserved" {
            claim.unreserved.push(Unreserved {
                attempt_id: r.attempt_id,
                job_id: r.job_id,
                owner_id: r.owner_id,
                operation: r.operation,
                input,
            });
            continue;
        }
        claim.started.push(Started {
            attempt_id: r.attempt_id,
            job_id: r.job_id,
            number: r.number,
            version: r.version,
            operation: r.operation,
            input,
            claim: token,
        });
    }
    Ok(claim)
}
