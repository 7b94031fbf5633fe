//! Pruning spend: owners' spend older than a day goes; the day's stays.

use onejob::roles::reconciler::prune_spend::PruneSpend;

use super::Bench;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spend_older_than_a_day_is_pruned() {
    let bench = Bench::new("").await;
    sqlx::query(
        "INSERT INTO owner_spend (owner_id, minute, stripe, tokens)
         VALUES ('acct_s', date_trunc('minute', now() - interval '25 hours'), 0, 10),
                ('acct_s', date_trunc('minute', now() - interval '3 days'), 1, 10),
                ('acct_s', date_trunc('minute', now() - interval '23 hours'), 0, 10),
                ('acct_s', date_trunc('minute', now()), 0, 10)",
    )
    .execute(bench.env.store.pool())
    .await
    .unwrap();
    assert_eq!(bench.run(&PruneSpend).await, 2);
    assert_eq!(bench.count("SELECT count(*) FROM owner_spend").await, 2);
    assert_eq!(bench.run(&PruneSpend).await, 0);
}
