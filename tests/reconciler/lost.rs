//! Lost messages: a queued attempt whose message is gone is republished,
//! then failed as lost; one waiting in a backlog is left alone.

use onejob::domain::AttemptStatus;
use onejob::roles::reconciler::lost::Lost;

use super::Bench;
use crate::common;

const STUCK: &str = "stuck_after = \"200ms\"\nmax_republish = 1";

/// The message published, then lost (taken off its queue): a run
/// republishes it; lost again, a later run fails the attempt as lost, and
/// its job moves on to a next attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_message_is_republished_then_its_attempt_failed() {
    let bench = Bench::new(STUCK).await;
    let (job_id, publish) = bench.env.admit(&bench.ctx, "acct_l", "l-1", "lost").await;
    bench.ctx.publish_outbox(&[publish]).await.unwrap();
    let ch = bench.ctx.connection.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    assert_eq!(bench.env.drain(&ch, &queue).await.len(), 1, "then lost");
    assert_eq!(
        bench.run_until_done(&Lost, "the attempt to be stuck").await,
        1
    );
    let again = common::wait_for_messages(&bench.env, &ch, &queue).await;
    assert_eq!(again.len(), 1, "republished once, then lost again");
    assert_eq!(
        bench
            .run_until_done(&Lost, "the attempt to be stuck again")
            .await,
        1
    );
    let job = bench.env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(error.starts_with("attempt_lost"), "{error}");
    assert_eq!(job.attempts.len(), 2, "the route moves on: {job:?}");
}

/// A queued attempt whose message waits in its queue (a backlog, no
/// consumer) is neither republished nor failed, however long it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_waiting_in_a_backlog_is_left_alone() {
    let bench = Bench::new(STUCK).await;
    let (job_id, publish) = bench
        .env
        .admit(&bench.ctx, "acct_l", "l-2", "backlog")
        .await;
    bench.ctx.publish_outbox(&[publish]).await.unwrap();
    let ch = bench.ctx.connection.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    let limit = std::time::Duration::from_secs(10);
    common::wait_for_depth("the message in its queue", limit, &ch, &queue, 1).await;
    // Stuck by time alone, as the database's clock says.
    common::wait_for(
        "stuck_after to pass",
        std::time::Duration::from_secs(10),
        || async {
            let stuck = bench
                .count("SELECT count(*) FROM outbox WHERE published_at < now() - interval '300 ms'")
                .await;
            (stuck == 1).then_some(())
        },
    )
    .await;
    for _ in 0..3 {
        assert_eq!(bench.run(&Lost).await, 0);
    }
    let job = bench.env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Queued);
    assert_eq!(common::depth(&ch, &queue).await, 1, "one copy, not two");
}
