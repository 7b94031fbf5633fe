//! Dead-lettered attempts: an attempt whose message died while it was still
//! `queued` is failed with the letter's reason, and its job moves on; one
//! that had started meanwhile is left to its call. Every letter stays.

use onejob::domain::AttemptStatus;
use onejob::roles::reconciler::dead_attempts::DeadAttempts;

use super::{Bench, dead_letter};
use crate::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_attempt_whose_message_died_is_failed_with_the_reason() {
    let bench = Bench::new("").await;
    let (dead, dead_message) = bench.env.admit(&bench.ctx, "acct_a", "a-1", "dead").await;
    let (running, running_message) = bench.env.admit(&bench.ctx, "acct_a", "a-2", "runs").await;
    let store = &bench.env.store;
    let running_job = store.jobs().job(running).await.unwrap().unwrap();
    let started = store
        .settle()
        .start(
            "primary",
            &[running_job.attempts[0].id],
            std::time::Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(started.len(), 1);
    let queue = onejob::broker::dead_letter_queue(&onejob::broker::attempts_queue("primary"));
    for message in [dead_message, running_message] {
        let body = serde_json::to_vec(&message.body).unwrap();
        dead_letter(&bench.ctx, &queue, &body, "delivery_limit").await;
    }
    assert_eq!(bench.run(&DeadAttempts).await, 1);
    let job = store.jobs().job(dead).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(
        error.starts_with("dead_lettered: delivery_limit"),
        "{error}"
    );
    assert_eq!(job.attempts.len(), 2, "the route moves on: {job:?}");
    let running = store.jobs().job(running).await.unwrap().unwrap();
    assert_eq!(running.attempts[0].status, AttemptStatus::Started);
    assert_eq!(bench.run(&DeadAttempts).await, 0);
    let ch = bench.ctx.connection.create_channel().await.unwrap();
    assert_eq!(common::depth(&ch, &queue).await, 2, "every letter stays");
}
