//! The pass over idempotency keys: a replayed answer, a 409.

use std::time::Duration;

use crate::common::{TestEnv, config, intent, mock, wait_for_status};
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use super::{evidence_rows, replay_config};

/// With `idempotency_key` evidence, an unknown call is sent again with the
/// same key: the provider answers with the first call's answer and runs
/// nothing new, and that answer settles the attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repeated_key_settles_an_unknown_with_the_first_answer() {
    let slow = mock(MockOptions {
        replay: true,
        delay: Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&replay_config(&slow.base_url()));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-replay", "replay me"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "{job:?}");
    let attempt = &job.attempts[0];
    assert_eq!(attempt.status, AttemptStatus::Succeeded);
    assert_eq!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: replay me")
    );
    assert_eq!(slow.stats.work(), 1, "the work ran once");
    assert!(slow.stats.requests() >= 2, "sent again");
    let keys = slow.stats.idempotency_keys();
    assert!(
        keys.iter().all(|k| *k == attempt.id.to_string()),
        "{keys:?}"
    );
    let rows = evidence_rows(&env, job_id).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].detail["evidence"], "replayed");
    producer.close().await;
    fleet.stop().await;
}

/// A `409` for the key (the first call did not complete) is a definite
/// failure: the attempt fails and the route moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_409_for_the_key_fails_the_attempt_and_the_route_moves_on() {
    let primary = mock(MockOptions {
        replay: true,
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&replay_config(&primary.base_url()));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-409", "mock:drop never completed"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    wait_for_status(&env, job_id, JobStatus::Unknown).await;
    primary.configure(|o| o.directives = false);
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 2, "{job:?}");
    let first = &job.attempts[0];
    assert_eq!(first.status, AttemptStatus::Failed);
    assert!(
        first
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("not_completed") && e.contains("409")),
        "{first:?}"
    );
    assert_eq!(
        primary.stats.work(),
        2,
        "the dropped call and the next attempt's"
    );
    let rows = evidence_rows(&env, job_id).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].detail["evidence"], "not completed");
    producer.close().await;
    fleet.stop().await;
}
