//! A worker that runs both intake and a provider's consumer claims and calls
//! a job it has just admitted while a call slot is free, without waiting for
//! the attempt's message to come back from the broker; the message is
//! published all the same, and its delivery is dropped. Every guarantee is
//! the claim's: one call per job, and a worker killed while the call it
//! started this way is at the provider leaves the attempt to the vanished
//! sweep, as any started attempt (the chaos tests kill workers at random
//! instants of the same path).

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use crate::common::chaos::{Workers, remove_logs};
use crate::common::{self, P, TestEnv, config, config_for, mock, wait_for, wait_for_status};

/// The log filter that shows the attempts started on admission.
const LOG: &str = "warn,onejob::roles::attempts=debug";

/// The statuses of a job's attempts, in number order.
async fn attempt_statuses(env: &TestEnv, job: onejob::domain::JobId) -> Vec<String> {
    sqlx::query_scalar("SELECT status FROM attempts WHERE job_id = $1 ORDER BY number")
        .bind(job.0)
        .fetch_all(env.store.pool())
        .await
        .unwrap()
}

/// One worker process with every role, logging the attempts started on
/// admission; and a producer.
async fn one_worker(env: &TestEnv, config: &std::path::Path) -> (Workers, Producer) {
    let url = env.amqp_url.clone();
    let workers = Workers::start_logging(1, env, config, move |_| url.clone(), LOG);
    (workers, Producer::connect(&env.amqp_url).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_calls_a_job_it_admitted_before_its_message_comes_back() {
    let provider = mock(MockOptions::default()).await;
    let (cfg, file) = config(&config_for(&[P("primary", &provider.base_url(), "")], ""));
    let env = TestEnv::new(&cfg).await;
    let (workers, producer) = one_worker(&env, &file.path).await;
    // One at a time: each finds the worker's call slots free.
    let mut jobs = Vec::new();
    for i in 0..10 {
        let job = common::submit(&producer, "acct_local", &format!("l-{i}"), "text").await;
        wait_for_status(&env, job, JobStatus::Succeeded).await;
        jobs.push(job);
    }
    for job in &jobs {
        assert_eq!(
            attempt_statuses(&env, *job).await,
            ["succeeded"],
            "job {job}"
        );
    }
    assert_eq!(provider.stats.requests(), 10, "one call per job");
    // The messages come back, and their deliveries are dropped.
    let log_file = workers.log_dir.join("worker-0.log");
    let log = wait_for(
        "a delivery to be dropped",
        Duration::from_secs(20),
        || async {
            let log = std::fs::read_to_string(&log_file).unwrap_or_default();
            log.contains("attempt started on admission: its delivery is dropped")
                .then_some(log)
        },
    )
    .await;
    assert!(
        log.matches("attempt started on admission").count() >= 2,
        "no attempt was started on admission:\n{log}"
    );
    producer.close().await;
    remove_logs(&workers.stop());
    assert_eq!(
        provider.stats.requests(),
        10,
        "a dropped delivery made no call"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_during_a_call_it_started_on_admission_leaves_it_unknown() {
    let provider = mock(MockOptions {
        delay: Duration::from_secs(4),
        ..MockOptions::default()
    })
    .await;
    let (cfg, file) = config(&config_for(&[P("primary", &provider.base_url(), "")], ""));
    let env = TestEnv::new(&cfg).await;
    let (mut workers, producer) = one_worker(&env, &file.path).await;
    let job = common::submit(&producer, "acct_kill", "k-0", "text").await;
    // The call is at the provider: the chosen instant.
    wait_for(
        "the call to reach the provider",
        Duration::from_secs(20),
        || async { (provider.stats.requests() == 1).then_some(()) },
    )
    .await;
    let log_dir = workers.log_dir.clone();
    let log = std::fs::read_to_string(log_dir.join("worker-0.log")).unwrap();
    assert!(
        log.contains("attempt started on admission"),
        "the call was not started on admission:\n{log}"
    );
    workers.kill_one(0);
    // The restarted worker finds the attempt started with no worker: unknown,
    // and the job blocked until it is resolved. Nothing else starts.
    common::wait_for_attempt(&env, job, AttemptStatus::Unknown).await;
    wait_for_status(&env, job, JobStatus::Unknown).await;
    assert_eq!(attempt_statuses(&env, job).await, ["unknown"]);
    assert_eq!(
        provider.stats.requests(),
        1,
        "no second call while the first is unknown"
    );
    producer.close().await;
    let logs = workers.stop();
    remove_logs(&logs);
}
