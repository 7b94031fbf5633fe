//! Settling a flush of finished attempts in one transaction, and each apart
//! when Postgres refuses the flush; the rows a settlement takes first.

use crate::edges::store::handles::Settle;
use crate::policy::next::{FailedJob, NextStep};
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::unknown::{Timeout, mark_unknown};
use crate::domain::{AttemptId, AttemptStatus, JobId};
use crate::edges::store::drafts::OutboxMessage;
use crate::edges::store::error::{Result, StoreError};
use crate::edges::store::settle::{Failure, Finished, Settled, Verdict};

/// The statuses a call's reported failure settles: `queued` is an attempt
/// called under a claim the database has since lost.
const CALLED: &[AttemptStatus] = &[
    AttemptStatus::Started,
    AttemptStatus::Unknown,
    AttemptStatus::Queued,
];

impl Settle<'_> {
    /// Settles finished attempts in one transaction: successes race through the
    /// compare-and-swap, unknowns block their job, failures plan the next attempt
    /// with `plan`. Returns what happened to each, in input order, and the outbox
    /// rows to publish now.
    ///
    /// One settlement never costs its neighbours: the flush takes its rows with
    /// `SKIP LOCKED`, so a job or attempt row held under someone else's lock
    /// comes out as [`Settled::Busy`] while the rest settle; and when Postgres
    /// refuses the flush (its data, a lock or statement timeout, a deadlock),
    /// each is settled in a transaction of its own, the one refused coming out
    /// as [`Settled::Refused`] (its data) or [`Settled::Busy`] (contention).
    /// A flush whose connection broke runs again whole: every step of it is
    /// guarded, so a flush that had committed unseen changes nothing the second
    /// time, and its outbox rows are the relay's.
    pub async fn finalize(
        self,
        finished: &[Finished],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<Settled>, Vec<OutboxMessage>)> {
        if finished.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let settle = |batch| {
            self.0.retrying_when(
                move || self.finalize_once(batch, plan),
                StoreError::is_connection_lost,
            )
        };
        match settle(finished).await {
            Err(e) if e.is_data_error() || e.is_contention() => {
                tracing::info!(error = %e, settlements = finished.len(), "Postgres refused a settlement flush; settling each apart");
            }
            other => return other,
        }
        let mut settled = Vec::with_capacity(finished.len());
        let mut publish = Vec::new();
        for one in finished.chunks(1) {
            match settle(one).await {
                Ok((outcome, rows)) => {
                    settled.extend(outcome);
                    publish.extend(rows);
                }
                Err(e) if e.is_contention() => {
                    tracing::info!(attempt_id = %one[0].attempt_id, error = %e, "a settlement met contention; it is settled again later");
                    crate::edges::metrics::db_retry(&e.retry_code());
                    settled.push(Settled::Busy);
                }
                Err(e) if e.is_data_error() => {
                    tracing::error!(attempt_id = %one[0].attempt_id, error = %e, "Postgres refused a settlement; its neighbours were settled without it");
                    settled.push(Settled::Refused {
                        error: e.to_string(),
                    });
                }
                // The ones settled so far are committed: their redelivered
                // messages find them settled and are dropped as duplicates, and
                // the relay publishes their outbox rows.
                Err(e) => return Err(e),
            }
        }
        Ok((settled, publish))
    }

    /// One try of [`Settle::finalize`](crate::edges::store::Settle::finalize): the whole flush in one transaction.
    async fn finalize_once(
        self,
        all: &[Finished],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<Settled>, Vec<OutboxMessage>)> {
        let mut tx = self.0.per_job.begin().await?;
        let mut settled: HashMap<AttemptId, Settled> = HashMap::new();
        let rows: Vec<(AttemptId, JobId)> = all.iter().map(|f| (f.attempt_id, f.job_id)).collect();
        let Taken { busy, kept } = take_rows(&mut tx, &rows).await?;
        let finished: Vec<&Finished> = all
            .iter()
            .filter(|f| !busy.contains(&f.attempt_id))
            .collect();
        for id in &busy {
            settled.insert(*id, Settled::Busy);
        }
        let mut drafts = Vec::new();
        let mut won = Vec::new();

        let wins: Vec<&Finished> = finished
            .iter()
            .copied()
            .filter(|f| matches!(f.verdict, Verdict::Succeeded(_)))
            .collect();
        if !wins.is_empty() {
            let successes = self.settle_successes(&mut tx, &wins).await?;
            settled.extend(successes.outcomes);
            drafts.extend(successes.events);
            won = successes.won;
        }

        let unknowns: Vec<Timeout> = finished
            .iter()
            .filter_map(|f| match &f.verdict {
                Verdict::Unknown { error } => Some(Timeout {
                    attempt_id: f.attempt_id,
                    error: error.clone(),
                    asked: f.asked,
                }),
                _ => None,
            })
            .collect();
        if !unknowns.is_empty() {
            let mut marked = mark_unknown(&mut tx, &unknowns, true).await?;
            for Timeout { attempt_id: id, .. } in &unknowns {
                settled.insert(*id, marked.remove(id).unwrap_or(Settled::Stale));
            }
        }

        let failures: Vec<Failure> = finished
            .iter()
            .copied()
            .filter_map(Failure::reported_by)
            .collect();
        if !failures.is_empty() {
            let (outcomes, more) = self
                .settle_failures(&mut tx, &failures, CALLED, plan, false, true)
                .await?;
            settled.extend(outcomes);
            drafts.extend(more);
            keep_costs(&mut tx, &failures, &settled).await?;
        }

        // The won jobs' other attempts are closed by the statement that writes
        // the outbox rows: a statement after the compare-and-swap, so its fresh
        // snapshot sees a timeout that committed while the compare-and-swap
        // waited for the job, without a round trip of its own.
        let outbox = self.0.outbox();
        let publish = outbox.insert_outbox_closing(&mut tx, &drafts, &won).await?;
        clear_kept(&mut tx, &kept).await?;
        tx.commit().await?;
        let outcomes = all
            .iter()
            .map(|f| settled.remove(&f.attempt_id).unwrap_or(Settled::Stale))
            .collect();
        Ok((outcomes, publish))
    }
}

impl Failure {
    /// The definite failure a finished call reports, if it reports one.
    fn reported_by(finished: &Finished) -> Option<Failure> {
        match &finished.verdict {
            Verdict::Failed {
                error,
                retryable,
                retry_after,
            } => Some(Failure {
                attempt_id: finished.attempt_id,
                error: error.clone(),
                retryable: *retryable,
                retry_after: *retry_after,
                usage: finished.usage.clone(),
                request_id: finished.provider_request_id.clone(),
            }),
            _ => None,
        }
    }
}

/// How long a settlement waits for a row it did not take at its start (another
/// attempt of a job it won, say) before it gives up and is settled again
/// later. A shorter `lock_timeout` set on the role or database is kept.
const SETTLEMENT_LOCK_PATIENCE: Duration = Duration::from_secs(1);

/// A failure whose attempt was closed before it was reported settles nothing
/// (`settled` has no outcome for it); this keeps on the attempt the usage and
/// request id it reports, where it has no usage yet: a call that answered
/// was paid for, whatever became of its attempt (the spend trigger counts it
/// against the owner).
async fn keep_costs(
    tx: &mut PgConnection,
    failures: &[Failure],
    settled: &HashMap<AttemptId, Settled>,
) -> Result<()> {
    let paid: Vec<&Failure> = failures
        .iter()
        .filter(|f| f.usage.is_some() && !settled.contains_key(&f.attempt_id))
        .collect();
    if paid.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = paid.iter().map(|f| f.attempt_id.0).collect();
    let usages: Vec<Option<Value>> = paid.iter().map(|f| f.usage.clone()).collect();
    let request_ids: Vec<Option<String>> = paid.iter().map(|f| f.request_id.clone()).collect();
    sqlx::query!(
        "UPDATE attempts a
         SET usage = i.usage,
             provider_request_id = COALESCE(a.provider_request_id, i.request_id)
         FROM unnest($1::uuid[], $2::jsonb[], $3::text[]) AS i(attempt_id, usage, request_id)
         WHERE a.id = i.attempt_id AND a.usage IS NULL
           AND a.status IN ('succeeded', 'failed', 'discarded', 'cancelled')",
        &ids,
        &usages as &[Option<Value>],
        &request_ids as &[Option<String>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// An answer kept on an attempt ends with its settlement, in its
/// transaction: one that closed its attempt was cleared by the trigger
/// `attempts_answer_closed`; this clears one whose attempt stays open (a kept
/// timeout, now `unknown`, or one already settled). No round trip when none
/// of the settlement's attempts had one.
async fn clear_kept(tx: &mut PgConnection, kept: &[Uuid]) -> Result<()> {
    if kept.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        "UPDATE attempts SET answer = NULL, kept_next_at = NULL
         WHERE id = ANY($1) AND answer IS NOT NULL",
        kept
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The rows a settlement took ([`take_rows`]).
pub(in crate::edges::store) struct Taken {
    /// The attempts whose job or attempt row was held: not settled now.
    pub(in crate::edges::store) busy: BTreeSet<AttemptId>,
    /// The attempts taken that have an answer kept on them: the settlement
    /// clears it.
    pub(in crate::edges::store) kept: Vec<Uuid>,
}

/// Takes the settlement's rows, jobs first, with `SKIP LOCKED`: a settlement
/// never waits for a row someone else holds (an operator's open transaction, a
/// migration, another worker settling a hedge of the same job). Returns the
/// attempts whose job or attempt row was held: they are not settled now. An
/// attempt that does not exist at all is not held: its settlement finds
/// nothing to change. Says too which attempts taken have a kept answer, in
/// the same round trip.
///
/// The same statement caps the transaction's `lock_timeout`
/// ([`SETTLEMENT_LOCK_PATIENCE`]), so that what is left to wait for (closing a
/// won job's other attempts) fails the flush in time rather than hang it.
pub(in crate::edges::store) async fn take_rows(
    tx: &mut PgConnection,
    rows: &[(AttemptId, JobId)],
) -> Result<Taken> {
    let attempts: Vec<Uuid> = rows.iter().map(|r| r.0.0).collect();
    let jobs: Vec<Uuid> = rows
        .iter()
        .map(|r| r.1.0)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let patience = i64::try_from(SETTLEMENT_LOCK_PATIENCE.as_millis()).unwrap_or(i64::MAX);
    let taken = sqlx::query!(
        r#"WITH patience AS (
               SELECT CASE WHEN current_setting('lock_timeout')::interval = interval '0'
                             OR current_setting('lock_timeout')::interval > make_interval(secs => $3::bigint / 1000.0)
                           THEN set_config('lock_timeout', $3::bigint::text, true) END AS lock_timeout
           ), jobs_taken AS (
               SELECT id FROM jobs WHERE id = ANY($2) ORDER BY id FOR UPDATE SKIP LOCKED
           )
           SELECT a.id AS "id!: AttemptId", a.answer IS NOT NULL AS "kept!"
           FROM attempts a, patience
           WHERE a.id = ANY($1) AND a.job_id IN (SELECT id FROM jobs_taken)
           ORDER BY a.id
           FOR UPDATE OF a SKIP LOCKED"#,
        &attempts,
        &jobs,
        patience,
    )
    .fetch_all(&mut *tx)
    .await?;
    let kept: Vec<Uuid> = taken.iter().filter(|r| r.kept).map(|r| r.id.0).collect();
    let taken: BTreeSet<AttemptId> = taken.into_iter().map(|r| r.id).collect();
    if taken.len() == rows.len() {
        return Ok(Taken {
            busy: BTreeSet::new(),
            kept,
        });
    }
    let missing: Vec<Uuid> = rows
        .iter()
        .filter(|r| !taken.contains(&r.0))
        .map(|r| r.0.0)
        .collect();
    let busy = sqlx::query_scalar!(
        r#"SELECT id AS "id!: AttemptId" FROM attempts WHERE id = ANY($1)"#,
        &missing
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();
    Ok(Taken { busy, kept })
}
