//! What the reconciler's passes ask of the tables: vanished workers, stuck
//! queued attempts, and hedging.

use crate::edges::store::handles::Sweeps;
use std::time::Duration;

use uuid::Uuid;

use super::settle::{Timeout, mark_unknown, take_rows};
use crate::domain::{AttemptId, JobId, JobStatus};
use crate::edges::store::HedgeCandidate;
use crate::edges::store::drafts::OutboxMessage;
use crate::edges::store::error::Result;
use crate::edges::store::next_turns::NextTurn;
use crate::edges::store::settle::Settled;

impl Sweeps<'_> {
    /// Queued attempts that never started although their message was last
    /// published `stuck_after` ago (it was dead-lettered, or its queue purged): republishes each
    /// (a duplicate is harmless: `queued → started` is guarded) and counts it.
    /// Returns the messages to publish now, and the attempts already republished
    /// `max_republish` times, for the caller to fail.
    ///
    /// Attempts of the providers in `backlogged` (their queue still holds
    /// messages) are left alone while their message may be waiting there:
    /// only one the queue has moved past is taken, that is one whose last
    /// message was published over a second before that of an attempt of the
    /// provider now `started`. (A queue is first in, first out; a message a
    /// busy worker holds unacked is the exception, and a duplicate of it is
    /// harmless.) So a message lost from a queue that other owners keep busy
    /// is sent again, and its turn does not keep its owner's place for ever.
    pub async fn stuck_queued(
        self,
        stuck_after: Duration,
        max_republish: i32,
        backlogged: &[String],
    ) -> Result<(Vec<OutboxMessage>, Vec<AttemptId>)> {
        let mut tx = self.0.pool.begin().await?;
        let stuck = sqlx::query!(
            r#"WITH moved AS (
                   -- How far each backlogged provider's queue has moved: the
                   -- newest message among its attempts now started.
                   SELECT b.provider, max(o.published_at) AS past
                   FROM attempts b JOIN outbox o ON o.message_id = b.id::text
                   WHERE b.status = 'started' AND b.provider = ANY($2)
                   GROUP BY b.provider
               ), candidates AS MATERIALIZED (
                   -- What may be stuck, read where it is few: the turns
                   -- handed out (a held one's message is not sent yet)...
                   SELECT t.attempt_id AS id FROM turns t
                   WHERE t.handed_out_at IS NOT NULL
                     AND (t.provider <> ALL($2) OR t.provider IN (SELECT provider FROM moved))
                   UNION ALL
                   -- ...and the queued attempts with no turn, handed back
                   -- by a claim cut off at a stop (or made before attempts
                   -- took turns): of running jobs, which are few.
                   SELECT a.id FROM jobs j JOIN attempts a ON a.job_id = j.id
                   WHERE j.status = 'running' AND a.status = 'queued'
                     AND (a.provider <> ALL($2) OR a.provider IN (SELECT provider FROM moved))
                     AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.attempt_id = a.id)
               )
               SELECT a.id AS "id: AttemptId", a.job_id AS "job_id: JobId", a.provider,
                      a.republished
               FROM candidates c
               JOIN attempts a ON a.id = c.id
               JOIN jobs j ON j.id = a.job_id
               LEFT JOIN moved m ON m.provider = a.provider
               CROSS JOIN LATERAL (
                   SELECT bool_or(o.published_at IS NULL) AS pending,
                          COALESCE(max(o.published_at), a.not_before) AS sent
                   FROM outbox o WHERE o.message_id = a.id::text
               ) o
               WHERE a.status = 'queued' AND j.status <> 'unknown'
                 AND NOT COALESCE(o.pending, false)
                 AND o.sent < now() - make_interval(secs => $1)
                 AND (a.provider <> ALL($2) OR o.sent < m.past - interval '1 second')
               ORDER BY a.id
               LIMIT 100
               FOR UPDATE OF a SKIP LOCKED"#,
            stuck_after.as_secs_f64(),
            backlogged,
        )
        .fetch_all(&mut *tx)
        .await?;
        let (exhausted, again): (Vec<_>, Vec<_>) = stuck
            .into_iter()
            .partition(|s| s.republished >= max_republish);
        let mut drafts = Vec::new();
        if !again.is_empty() {
            let ids: Vec<Uuid> = again.iter().map(|s| s.id.0).collect();
            sqlx::query!(
                "UPDATE attempts SET republished = republished + 1, not_before = now()
                 WHERE id = ANY($1)",
                &ids
            )
            .execute(&mut *tx)
            .await?;
            for s in &again {
                tracing::warn!(attempt_id = %s.id, republished = s.republished + 1, "queued attempt never started; republishing its message");
                drafts.push(
                    self.0
                        .routes
                        .attempt_draft(s.id, s.job_id, &s.provider, None),
                );
            }
        }
        let publish = self.0.outbox().insert(&mut tx, &drafts).await?;
        tx.commit().await?;
        Ok((publish, exhausted.into_iter().map(|s| s.id).collect()))
    }

    /// Jobs of operations with `hedge_after` whose only attempt has been `started`
    /// longer than that, with no hedge yet.
    pub async fn hedge_candidates(
        self,
        hedge_after: &[(String, Duration)],
    ) -> Result<Vec<HedgeCandidate>> {
        if hedge_after.is_empty() {
            return Ok(Vec::new());
        }
        let operations: Vec<String> = hedge_after.iter().map(|h| h.0.clone()).collect();
        let seconds: Vec<f64> = hedge_after.iter().map(|h| h.1.as_secs_f64()).collect();
        let rows = sqlx::query!(
            r#"SELECT a.job_id AS "job_id: JobId", a.provider, j.operation,
                      (SELECT count(*) FROM attempts x WHERE x.job_id = a.job_id) AS "made!"
               FROM attempts a
               JOIN jobs j ON j.id = a.job_id
               JOIN unnest($1::text[], $2::float8[]) AS h(operation, secs) ON h.operation = j.operation
               WHERE a.status = 'started' AND a.lane = 0 AND j.status = 'running'
                 AND a.started_at + make_interval(secs => h.secs) < now()
                 AND NOT EXISTS (SELECT 1 FROM attempts b WHERE b.job_id = a.job_id AND b.lane = 1)
               ORDER BY a.started_at
               LIMIT 100"#,
            &operations,
            &seconds,
        )
        .fetch_all(&self.0.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| HedgeCandidate {
                job_id: r.job_id,
                provider: r.provider,
                operation: r.operation,
                attempts_made: u32::try_from(r.made).unwrap_or(u32::MAX),
            })
            .collect())
    }

    /// Started attempts silent past their deadline plus `grace` lost their worker:
    /// they and their jobs become `unknown` (never `failed`: the provider may still
    /// be working). One whose job has already ended blocks nothing: it is
    /// `discarded`, with the reason.
    pub async fn expire_vanished(self, grace: Duration) -> Result<Vec<AttemptId>> {
        let mut tx = self.0.pool.begin().await?;
        // An attempt with a kept answer has not vanished: its answer is
        // settled by its own pass. Rows held under someone else's lock are
        // left for the next sweep, so one held row never fails the sweep.
        let vanished: Vec<(AttemptId, JobId)> = sqlx::query!(
            r#"SELECT id AS "id: AttemptId", job_id AS "job_id: JobId" FROM attempts
               WHERE status = 'started' AND deadline_at + make_interval(secs => $1) < now()
                 AND answer IS NULL
               ORDER BY id
               LIMIT 500"#,
            grace.as_secs_f64()
        )
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|r| (r.id, r.job_id))
        .collect();
        if vanished.is_empty() {
            return Ok(Vec::new());
        }
        let held = take_rows(&mut tx, &vanished).await?.busy;
        // Decided as for any timeout: under the attempts' and jobs' locks, so a
        // job that ended meanwhile gets a discarded attempt, never an unknown one.
        let error = "worker_vanished: no outcome by the deadline plus the grace period";
        let unknowns: Vec<Timeout> = vanished
            .iter()
            .filter(|(id, _)| !held.contains(id))
            .map(|(id, _)| Timeout {
                attempt_id: *id,
                error: error.to_owned(),
                asked: None,
            })
            .collect();
        let marked = mark_unknown(&mut tx, &unknowns, false).await?;
        tx.commit().await?;
        Ok(marked
            .into_iter()
            .filter(|(_, s)| *s == Settled::Unknown)
            .map(|(id, _)| id)
            .collect())
    }

    /// Starts a hedge: one parallel attempt on `provider` beside a job's running
    /// attempt. Guarded in one statement under the job's row lock: the job must be
    /// `running` with exactly one open attempt, `started`, in the main lane, and no
    /// attempt `unknown`. The hedge takes its turn on `provider` as a first
    /// attempt does: held, and handed out by that provider's hand-out.
    /// Returns the new attempt, or `None` when the guard refused or the job
    /// row is held under someone else's lock (the next pass looks again).
    pub async fn hedge(self, job: JobId, provider: &str) -> Result<Option<AttemptId>> {
        let id = AttemptId::new();
        let mut tx = self.0.pool.begin().await?;
        let locked = sqlx::query_scalar!(
            r#"SELECT status AS "status: JobStatus" FROM jobs WHERE id = $1
               FOR UPDATE SKIP LOCKED"#,
            job.0
        )
        .fetch_optional(&mut *tx)
        .await?;
        if locked != Some(JobStatus::Running) {
            return Ok(None);
        }
        // A hedge is one more attempt in flight: under `max_in_flight` it
        // waits for room like a turn does, counted under the owner's lock
        // (taken first, so that the count's snapshot follows it).
        let owner = sqlx::query!(
            r#"SELECT j.owner_id, COALESCE(o.max_in_flight, $2) AS "max_in_flight!"
               FROM jobs j LEFT JOIN owners o ON o.owner_id = j.owner_id
               WHERE j.id = $1"#,
            job.0,
            self.0.routes.owners.max_in_flight,
        )
        .fetch_one(&mut *tx)
        .await?;
        let room = owner.max_in_flight == 0 || {
            sqlx::query!("SELECT owner_lock($1)", owner.owner_id)
                .fetch_one(&mut *tx)
                .await?;
            sqlx::query_scalar!(
                r#"SELECT owner_in_flight($1) < $2 AS "room!""#,
                owner.owner_id,
                owner.max_in_flight
            )
            .fetch_one(&mut *tx)
            .await?
        };
        if !room {
            return Ok(None);
        }
        let inserted = sqlx::query!(
            "INSERT INTO attempts (id, job_id, number, provider, lane)
             SELECT $1, $2, max(number) + 1, $3, 1 FROM attempts WHERE job_id = $2
             HAVING count(*) FILTER (WHERE status IN ('queued', 'unknown')) = 0
                AND count(*) FILTER (WHERE status = 'started' AND lane = 0) = 1
                AND count(*) FILTER (WHERE lane = 1 AND status IN ('queued', 'started', 'unknown')) = 0",
            id.0,
            job.0,
            provider,
        )
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() == 0 {
            return Ok(None);
        }
        // It takes its turn on its provider as a first attempt does: held,
        // for the provider's hand-out.
        let turn = NextTurn {
            attempt: id,
            job,
            provider,
            due: None,
        };
        self.0.hold_turns(&mut tx, &[turn]).await?;
        tx.commit().await?;
        Ok(Some(id))
    }

    /// Analyzes the busy tables whose statistics are missing or far behind:
    /// never analyzed, or changed by more than four times the rows they had when
    /// last analyzed (and by a thousand rows at least). Returns the tables
    /// analyzed.
    ///
    /// Autovacuum does this too, but only on its round (once a minute by
    /// default). A fresh database that takes a backlog would meanwhile be
    /// planned with default estimates (every `job_id` shared by 200 attempts,
    /// say), and the planner then scans whole tables for a few rows. The rule
    /// fires a handful of times as the tables grow (at about a thousand rows,
    /// five thousand, …) and never in a steady state.
    pub async fn refresh_statistics(self) -> Result<Vec<String>> {
        let stale = sqlx::query_scalar!(
            r#"SELECT s.relname::text AS "table!"
               FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
               WHERE s.schemaname = current_schema()
                 AND s.relname IN ('jobs', 'attempts', 'outbox')
                 AND s.n_mod_since_analyze >= 1000
                 AND (c.reltuples < 0 OR s.n_mod_since_analyze > 4 * c.reltuples)"#
        )
        .fetch_all(&self.0.pool)
        .await?;
        self.on_busy_tables("ANALYZE", &stale).await?;
        Ok(stale)
    }

    /// Runs `command` (`ANALYZE`, `VACUUM (…)`: commands that take a table's
    /// name last and cannot run in a transaction) on each of `tables` that is
    /// one of onejob's busy tables (or `turns`), one simple query each.
    pub(super) async fn on_busy_tables(self, command: &str, tables: &[String]) -> Result<()> {
        for table in tables {
            // Only these three fixed identifiers are ever spliced in.
            let table = match table.as_str() {
                "jobs" => "jobs",
                "attempts" => "attempts",
                "outbox" => "outbox",
                "turns" => "turns",
                _ => continue,
            };
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("{command} {table}")))
                .execute(&self.0.pool)
                .await?;
        }
        Ok(())
    }
}
