//! Pruning the outbox: published rows past `outbox_retention` go; recent
//! ones, and rows not yet published, stay.

use onejob::roles::reconciler::prune_outbox::PruneOutbox;

use super::Bench;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_published_rows_past_their_retention_are_pruned() {
    let bench = Bench::new("outbox_retention = \"1m\"").await;
    sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, published_at, not_before)
         VALUES ('onejob.events', 'job.succeeded', 'old', '{}', now() - interval '2 hours', now()),
                ('onejob.events', 'job.succeeded', 'older', '{}', now() - interval '2 days', now()),
                ('onejob.events', 'job.succeeded', 'recent', '{}', now() - interval '10 seconds', now()),
                ('onejob.events', 'job.succeeded', 'pending', '{}', NULL, now() + interval '1 day')",
    )
    .execute(bench.env.store.pool())
    .await
    .unwrap();
    assert_eq!(bench.run(&PruneOutbox).await, 2);
    let left: Vec<String> = sqlx::query_scalar("SELECT message_id FROM outbox ORDER BY id")
        .fetch_all(bench.env.store.pool())
        .await
        .unwrap();
    assert_eq!(left, ["recent", "pending"]);
    assert_eq!(bench.run(&PruneOutbox).await, 0);
}
