//! Statistics: a fresh database that takes a backlog is analyzed once its
//! busy tables have changed enough, and left alone once they are current.

use onejob::roles::reconciler::statistics::Statistics;

use super::Bench;
use crate::common;

/// Three thousand jobs filled in: a run analyzes `jobs` and `attempts`,
/// and the next, with their statistics current, analyzes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_filled_fresh_database_is_analyzed_once() {
    let bench = Bench::new("").await;
    let mut db = bench.env.store.pool().acquire().await.unwrap();
    // Autovacuum kept out of this private database's busy tables, so that
    // only the pass analyzes them.
    for table in ["jobs", "attempts"] {
        let off = format!("ALTER TABLE {table} SET (autovacuum_enabled = false)");
        sqlx::query(sqlx::AssertSqlSafe(off))
            .execute(&mut *db)
            .await
            .unwrap();
    }
    common::fill_jobs(&mut db, "stats", 3000, "succeeded", 0.0, 60.0, "summarize").await;
    drop(db);
    let analyzed = bench
        .run_until_done(&Statistics, "the changes to be counted")
        .await;
    assert!(analyzed >= 1, "{analyzed}");
    let never: i64 = bench
        .count("SELECT count(*) FROM pg_stat_user_tables WHERE relname IN ('jobs', 'attempts') AND last_analyze IS NULL")
        .await;
    assert_eq!(never, 0, "both busy tables analyzed");
    assert_eq!(bench.run(&Statistics).await, 0, "current now");
}
