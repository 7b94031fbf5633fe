//! Dead-lettered valid intents: one the broker dead-lettered for its
//! delivery limit becomes a job all the same, once; an invalid one, or one
//! dead-lettered for another reason, does not. Every letter stays.

use onejob::domain::JobStatus;
use onejob::roles::reconciler::dead_intents::DeadIntents;

use super::{Bench, dead_letter};
use crate::common::{self, intent};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_valid_intent_dead_lettered_at_its_limit_becomes_one_job() {
    let bench = Bench::new("").await;
    let queue = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    let valid = serde_json::to_vec(&intent("acct_d", "d-1", "dead")).unwrap();
    let other = serde_json::to_vec(&intent("acct_d", "d-2", "rejected")).unwrap();
    dead_letter(&bench.ctx, &queue, &valid, "delivery_limit").await;
    dead_letter(&bench.ctx, &queue, b"{not json", "delivery_limit").await;
    dead_letter(&bench.ctx, &queue, &other, "invalid_input").await;
    assert_eq!(bench.run(&DeadIntents).await, 1);
    let jobs: Vec<(String, String)> =
        sqlx::query_as("SELECT idempotency_key, status::text FROM jobs")
            .fetch_all(bench.env.store.pool())
            .await
            .unwrap();
    assert_eq!(jobs, [("d-1".to_owned(), JobStatus::Queued.to_string())]);
    assert_eq!(
        bench.run(&DeadIntents).await,
        0,
        "its identity's job: a duplicate"
    );
    assert_eq!(bench.count("SELECT count(*) FROM jobs").await, 1);
    let ch = bench.ctx.connection.create_channel().await.unwrap();
    assert_eq!(common::depth(&ch, &queue).await, 3, "every letter stays");
}
