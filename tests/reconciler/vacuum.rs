//! Vacuum: the busy tables are vacuumed by onejob only where the server runs
//! no autovacuum; where it runs, they are left to it.

use sqlx::Connection;

use onejob::roles::reconciler::vacuum::Vacuum;

use super::Bench;
use crate::common;

/// A fresh database: nothing to vacuum. Then 3,000 jobs deleted: once the
/// server reports their dead rows, a run vacuums `jobs` and `attempts` where
/// the server runs no autovacuum (this machine's CI configuration), and
/// nothing where it does; a second run has nothing to do either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_busy_tables_are_vacuumed_only_where_autovacuum_is_off() {
    let bench = Bench::new("").await;
    let autovacuum: bool = sqlx::query_scalar("SELECT current_setting('autovacuum')::bool")
        .fetch_one(bench.env.store.pool())
        .await
        .unwrap();
    assert_eq!(bench.run(&Vacuum).await, 0, "nothing dead yet");
    let mut db = bench.env.store.pool().acquire().await.unwrap();
    common::fill_jobs(&mut db, "vac", 3000, "succeeded", 0.0, 60.0, "summarize").await;
    // One transaction: `jobs.completed_by` is checked at its commit.
    let mut tx = db.begin().await.unwrap();
    for table in ["attempts", "jobs"] {
        let delete = format!("DELETE FROM {table}");
        sqlx::query(sqlx::AssertSqlSafe(delete))
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    drop(db);
    bench
        .dead_rows("jobs", "the deletes to be reported", |dead| dead >= 3000)
        .await;
    let vacuumed = bench.run(&Vacuum).await;
    if autovacuum {
        assert_eq!(vacuumed, 0, "left to the server's autovacuum");
    } else {
        assert!(vacuumed >= 2, "jobs and attempts: {vacuumed}");
        assert_eq!(bench.run(&Vacuum).await, 0);
    }
}
