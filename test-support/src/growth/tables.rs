//! The run's tables: the rows every prune must keep, the fills of ended jobs,
//! the tables' sizes, a digest of the kept rows, and waiting for the pruning
//! worker and the vacuum.

use std::time::{Duration, Instant};

use sqlx::PgConnection;

use super::report::{Size, Sizes};
use crate::drain::{Worker, say};
use crate::fill_jobs;

/// Rows that must survive every prune, by kind: (key prefix, status, count,
/// age in seconds).
pub(super) const KEPT: [(&str, &str, i64, f64); 4] = [
    // Just inside the 7 days succeeded jobs are kept by default.
    ("keep-inside-", "succeeded", 1000, 7.0 * 86400.0 - 3600.0),
    // Inside the 30 days for failed ones.
    ("keep-failed-", "failed", 1000, 29.0 * 86400.0),
    // Never pruned, however old.
    ("keep-unknown-", "unknown", 1000, 90.0 * 86400.0),
    // Old enough, but their event is unpublished (the floor holds it back).
    ("keep-unpublished-", "succeeded", 100, 60.0 * 86400.0),
];

/// Inserts `n` ended jobs of the mix (80% succeeded, 15% failed, 5% cancelled)
/// that ended 31 to 61 days ago, with their attempts. Jobs and attempts made.
pub(super) async fn fill_ended(
    db: &mut PgConnection,
    prefix: &str,
    n: usize,
    operation: &str,
) -> (i64, i64) {
    let n = i64::try_from(n).expect("n fits");
    fill_jobs(
        db,
        prefix,
        n,
        "mix",
        31.0 * 86400.0,
        30.0 * 86400.0,
        operation,
    )
    .await
}

/// The three tables' sizes, as `at`.
pub(super) async fn sizes_at(db: &mut PgConnection, at: &str) -> Sizes {
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, pg_relation_size(oid), pg_indexes_size(oid), pg_total_relation_size(oid)
         FROM pg_class
         WHERE relname IN ('jobs', 'attempts', 'outbox') AND relnamespace = 'public'::regnamespace
         ORDER BY relname DESC",
    )
    .fetch_all(db)
    .await
    .expect("read the tables' sizes");
    let sizes = Sizes {
        at: at.to_owned(),
        tables: rows
            .into_iter()
            .map(|(table, heap, indexes, total)| Size {
                table,
                heap,
                indexes,
                total,
            })
            .collect(),
    };
    say(&format!(
        "{at}: {:.1} MiB",
        sizes.total() as f64 / (1024.0 * 1024.0)
    ));
    sizes
}

/// Every row that is not a fill's, with its attempts: how many, and a digest.
pub(super) async fn kept_rows(db: &mut PgConnection) -> (i64, String) {
    sqlx::query_as(
        "SELECT count(*), md5(coalesce(string_agg(
                    j.id::text || j.status || j.version || j.updated_at::text || coalesce(a.rows, ''),
                    ',' ORDER BY j.id), ''))
         FROM jobs j
         LEFT JOIN LATERAL (
             SELECT string_agg(a.id::text || a.status || coalesce(a.finished_at::text, ''), ',' ORDER BY a.id) AS rows
             FROM attempts a WHERE a.job_id = j.id) a ON true
         WHERE j.idempotency_key !~ '^g[0-9]+-' AND j.idempotency_key !~ '^b[0-9]+-'",
    )
    .fetch_one(db)
    .await
    .expect("digest the kept rows")
}

/// The pruning worker's `onejob_pruned_total{table="jobs"}`.
pub(super) async fn pruned(worker: &Worker) -> u64 {
    let n = worker
        .metrics()
        .await
        .value("onejob_pruned_total", "table=\"jobs\"");
    if n.is_nan() { 0 } else { n as u64 }
}

/// Waits until the statistics count `jobs` and `attempts` deleted rows (a
/// backend reports its counts up to ten seconds late) and then until neither
/// has more dead rows than autovacuum's threshold: whoever vacuums has caught
/// up.
pub(super) async fn vacuumed(db: &mut PgConnection, jobs: i64, attempts: i64, limit: Duration) {
    let began = Instant::now();
    loop {
        let (reported, behind): (bool, i64) = sqlx::query_as(
            "SELECT bool_and(s.n_tup_del >= CASE s.relname WHEN 'jobs' THEN $1 ELSE $2 END),
                    count(*) FILTER (WHERE s.n_dead_tup > current_setting('autovacuum_vacuum_threshold')::float8
                        + current_setting('autovacuum_vacuum_scale_factor')::float8 * greatest(c.reltuples, 0))
             FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
             WHERE s.relname IN ('jobs', 'attempts') AND s.schemaname = 'public'",
        )
        .bind(jobs)
        .bind(attempts)
        .fetch_one(&mut *db)
        .await
        .expect("read the dead rows");
        if reported && behind == 0 {
            return;
        }
        assert!(
            began.elapsed() < limit,
            "the tables were not vacuumed within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
