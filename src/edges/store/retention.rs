//! Retention: ended jobs are deleted, with their attempts, once they have been
//! kept for as long as their operation's retention says for how they ended.
//! `unknown`, `queued` and `running` jobs are never touched, nor is a job any of
//! whose outbox rows (its `job.*` event, an attempt message) is still
//! unpublished, nor an ended job with an attempt still open (a cancelled job
//! whose call is in flight: its answer is settled `discarded`, its usage
//! kept, before the job may go). A job's published outbox rows are gone already: every retention
//! is at least `outbox_retention` (the configuration checks it).
//!
//! Each pass is one statement over a bounded batch. It takes the jobs with
//! `FOR UPDATE SKIP LOCKED`, so it never waits for intake or a settlement, and
//! it deletes only rows nobody else writes: the attempts of the jobs it takes
//! are all ended, and no guarded statement matches them. An intent whose identity is
//! being pruned waits for that commit and then makes a new job.
//!
//! Deleted rows free their space only once a `VACUUM` has run. Where the server
//! runs autovacuum that is its job; where it does not (`autovacuum = off`),
//! [`Pruning::vacuum_if_due`](crate::edges::store::Pruning::vacuum_if_due) does it for onejob's own tables, by autovacuum's
//! rule, so that pruned space is reused instead of the tables growing forever.

use crate::edges::store::handles::Pruning;
use std::time::Duration;

use super::Result;
use crate::settings::config::{Config, Retention};

/// How long each kind of ended job is kept: the `[retention]` defaults, and each
/// configured operation's own.
#[derive(Clone, Debug)]
pub struct Policy {
    operations: Vec<String>,
    statuses: Vec<String>,
    seconds: Vec<f64>,
    shortest: Duration,
}

impl Policy {
    /// The configuration's retention.
    pub fn of(config: &Config) -> Policy {
        let mut policy = Policy::uniform(config.retention);
        for op in config.operations.values() {
            policy.add(&op.name, op.retention);
        }
        policy
    }

    /// The same retention for every operation.
    pub fn uniform(retention: Retention) -> Policy {
        let mut policy = Policy {
            operations: Vec::new(),
            statuses: Vec::new(),
            seconds: Vec::new(),
            shortest: Duration::MAX,
        };
        // The empty operation name holds the defaults.
        policy.add("", retention);
        policy
    }

    /// Every ended job older than `age`, whatever its operation.
    pub fn older_than(age: Duration) -> Policy {
        Policy::uniform(Retention {
            succeeded: age,
            failed: age,
            cancelled: age,
        })
    }

    fn add(&mut self, operation: &str, retention: Retention) {
        for (status, kept) in retention.by_status() {
            self.operations.push(operation.to_owned());
            self.statuses.push(status.as_str().to_owned());
            self.seconds.push(kept.as_secs_f64());
            self.shortest = self.shortest.min(kept);
        }
    }
}

/// What one pruning pass did (or, dry, would do).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Jobs deleted.
    pub jobs: u64,
    /// Their attempts, deleted with them.
    pub attempts: u64,
}

/// What a pruning pass found.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pass {
    /// What it deleted (or, dry, would delete).
    pub pruned: Pruned,
    /// How long ago the oldest job it took had ended; `None` when it took none.
    pub oldest: Option<Duration>,
}

impl Pruning<'_> {
    /// Deletes up to `limit` ended jobs past their retention, oldest ending
    /// first, with their attempts; `dry` counts them and deletes nothing.
    pub async fn prune_jobs(self, policy: &Policy, limit: i64, dry: bool) -> Result<Pass> {
        let row = sqlx::query!(
            r#"WITH policy AS (
                   SELECT * FROM unnest($1::text[], $2::text[], $3::float8[]) AS p(operation, status, secs)
               ),
               -- Jobs with an outbox row still unpublished: an event (its id is
               -- `job_id:version`) or an attempt message (the attempt's id). Few,
               -- found from the outbox's pending rows, each by an index.
               held AS MATERIALIZED (
                   SELECT CASE WHEN split_part(ob.message_id, ':', 1) ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                               THEN split_part(ob.message_id, ':', 1)::uuid END AS job_id
                   FROM outbox ob WHERE ob.published_at IS NULL AND ob.message_id LIKE '%:%'
                   UNION
                   SELECT a.job_id FROM outbox ob
                   JOIN attempts a ON a.id = CASE WHEN ob.message_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                                                  THEN ob.message_id::uuid END
                   WHERE ob.published_at IS NULL AND ob.message_id NOT LIKE '%:%'
               ),
               doomed AS (
                   SELECT j.id, j.updated_at FROM jobs j
                   JOIN policy d ON d.operation = '' AND d.status = j.status
                   LEFT JOIN policy o ON o.operation = j.operation AND o.status = j.status
                   WHERE j.status IN ('succeeded', 'failed', 'cancelled')
                     AND j.updated_at < now() - make_interval(secs => $4)
                     AND j.updated_at < now() - make_interval(secs => COALESCE(o.secs, d.secs))
                     AND NOT EXISTS (SELECT 1 FROM held h WHERE h.job_id = j.id)
                     -- An attempt still calling its provider (a cancelled job's,
                     -- a hedge's) keeps its job: its answer ends it `discarded`,
                     -- its usage kept.
                     AND NOT EXISTS (SELECT 1 FROM attempts x
                                     WHERE x.job_id = j.id
                                       AND x.status IN ('queued', 'started', 'unknown'))
                   ORDER BY j.updated_at
                   LIMIT $5
                   FOR UPDATE OF j SKIP LOCKED
               ),
               -- The deletes find their rows by the ids as one array: by their
               -- indexes whatever the planner thinks of the tables' sizes.
               ids AS (SELECT array_agg(id) AS ids FROM doomed),
               attempts_gone AS (
                   DELETE FROM attempts a WHERE a.job_id = ANY((SELECT ids FROM ids)::uuid[]) AND NOT $6 RETURNING a.id
               ),
               jobs_gone AS (
                   DELETE FROM jobs j WHERE j.id = ANY((SELECT ids FROM ids)::uuid[]) AND NOT $6 RETURNING j.id
               )
               SELECT CASE WHEN $6 THEN (SELECT count(*) FROM doomed)
                           ELSE (SELECT count(*) FROM jobs_gone) END AS "jobs!",
                      CASE WHEN $6 THEN (SELECT count(*) FROM attempts a WHERE a.job_id = ANY((SELECT ids FROM ids)::uuid[]))
                           ELSE (SELECT count(*) FROM attempts_gone) END AS "attempts!",
                      (SELECT extract(epoch FROM now() - min(updated_at))::float8 FROM doomed) AS "oldest_seconds""#,
            &policy.operations,
            &policy.statuses,
            &policy.seconds,
            policy.shortest.as_secs_f64(),
            limit,
            dry,
        )
        .fetch_one(&self.0.pool)
        .await?;
        Ok(Pass {
            pruned: Pruned {
                jobs: u64::try_from(row.jobs).unwrap_or(0),
                attempts: u64::try_from(row.attempts).unwrap_or(0),
            },
            oldest: row
                .oldest_seconds
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64),
        })
    }

    /// Where the server does not run autovacuum, vacuums (and analyzes) each of
    /// onejob's busy tables (`jobs`, `attempts`, `outbox`) whose dead rows are
    /// past autovacuum's own threshold (`autovacuum_vacuum_threshold` +
    /// `autovacuum_vacuum_scale_factor` × its rows), skipping any another
    /// session is vacuuming. The tables it vacuumed; none where autovacuum runs.
    pub async fn vacuum_if_due(self) -> Result<Vec<String>> {
        let due = sqlx::query_scalar!(
            r#"SELECT s.relname::text AS "table!" FROM pg_stat_user_tables s
               JOIN pg_class c ON c.oid = s.relid
               WHERE s.schemaname = current_schema()
                 AND s.relname IN ('jobs', 'attempts', 'outbox')
                 AND NOT current_setting('autovacuum')::bool
                 AND s.n_dead_tup > current_setting('autovacuum_vacuum_threshold')::float8
                     + current_setting('autovacuum_vacuum_scale_factor')::float8 * greatest(c.reltuples, 0)
               ORDER BY s.relname"#
        )
        .fetch_all(&self.0.pool)
        .await?;
        self.0
            .sweeps()
            .on_busy_tables("VACUUM (ANALYZE, SKIP_LOCKED)", &due)
            .await?;
        Ok(due)
    }

    /// Prunes batch after batch of `batch` jobs until one comes back short,
    /// `max_batches` ran, or `stop` says so, pausing `pause` between batches (room
    /// for intake and settlements). The total, and the oldest job's age as the
    /// first batch found it.
    pub async fn prune_batches(
        self,
        policy: &Policy,
        batch: i64,
        max_batches: usize,
        pause: Duration,
        stop: impl Fn() -> bool,
    ) -> Result<Pass> {
        let mut total = Pass::default();
        for n in 0..max_batches {
            let pass = self.prune_jobs(policy, batch, false).await?;
            crate::edges::metrics::pruned(pass.pruned.jobs, pass.pruned.attempts);
            if n == 0 {
                total.oldest = pass.oldest;
            }
            total.pruned.jobs += pass.pruned.jobs;
            total.pruned.attempts += pass.pruned.attempts;
            if pass.pruned.jobs < u64::try_from(batch).unwrap_or(0) || stop() {
                break;
            }
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
        }
        Ok(total)
    }
}
