//! `turns` vacuumed once its dead rows pass autovacuum's threshold, whether
//! or not the server runs autovacuum; not before.

use onejob::roles::reconciler::vacuum_turns::VacuumTurns;

use super::Bench;
use crate::common;

/// 3,000 turns made and ended (dead rows past the floor of 2,000): once the
/// server reports them, one run vacuums `turns`, and the next finds it clean.
/// Before, a fresh `turns` is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn turns_is_vacuumed_once_its_dead_rows_are_due() {
    let bench = Bench::new("").await;
    let pool = bench.env.store.pool();
    assert_eq!(bench.run(&VacuumTurns).await, 0, "nothing dead yet");
    let mut db = pool.acquire().await.unwrap();
    // Autovacuum kept out, so that only the pass vacuums.
    sqlx::query("ALTER TABLE turns SET (autovacuum_enabled = false)")
        .execute(&mut *db)
        .await
        .unwrap();
    common::fill_jobs(&mut db, "turns", 3000, "succeeded", 0.0, 60.0, "summarize").await;
    sqlx::query(
        "INSERT INTO turns (attempt_id, owner_id, provider, due_at, handed_out_at)
         SELECT id, 'acct_t', 'primary', now(), now() FROM attempts",
    )
    .execute(&mut *db)
    .await
    .unwrap();
    sqlx::query("DELETE FROM turns")
        .execute(&mut *db)
        .await
        .unwrap();
    drop(db);
    bench
        .dead_rows("turns", "the dead rows to be reported", |dead| dead >= 3000)
        .await;
    assert_eq!(bench.run(&VacuumTurns).await, 1);
    let vacuumed = bench
        .count("SELECT count(*) FROM pg_stat_user_tables WHERE relname = 'turns' AND last_vacuum IS NOT NULL")
        .await;
    assert_eq!(vacuumed, 1);
    bench
        .dead_rows("turns", "the vacuum to be reported", |dead| dead < 2000)
        .await;
    assert_eq!(bench.run(&VacuumTurns).await, 0, "clean now");
}
