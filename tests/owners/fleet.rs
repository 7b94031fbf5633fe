//! The limits hold across worker processes: two `onejob-worker` processes
//! admit one owner's intents from the same queue, and call for its jobs from
//! the same provider queue, and the owner's bucket, budget and flight are the
//! same for both, because all live in Postgres.

use std::time::Duration;

use futures_util::future::join_all;
use lapin::options::QueueDeclareOptions;
use onejob::broker::INTENTS_QUEUE;
use onejob::domain::JobStatus;
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use super::config_with_owners;
use crate::common::chaos::Workers;
use crate::common::{self, TestEnv, config, mock, wait_for, wait_for_status};

/// Waits until `count` consumers take intents.
async fn intake_consumers(env: &TestEnv, count: u32) {
    let amqp = env.amqp().await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let consumers = || async {
        // A passive declare of a queue not declared yet closes its channel.
        let ch = amqp.create_channel().await.ok()?;
        let q = ch
            .queue_declare(INTENTS_QUEUE.into(), passive, Default::default())
            .await
            .ok()?;
        let _ = ch.close(200, "counted".into()).await;
        (q.consumer_count() >= count).then_some(())
    };
    wait_for(
        "the workers' intake consumers",
        Duration::from_secs(60),
        consumers,
    )
    .await;
}

/// Two worker processes on `env`, logging at `filter`, both taking intents;
/// and a producer.
async fn two_workers(env: &TestEnv, config: &std::path::Path, filter: &str) -> (Workers, Producer) {
    let amqp_url = env.amqp_url.clone();
    let workers = Workers::start_logging(2, env, config, move |_| amqp_url.clone(), filter);
    intake_consumers(env, 2).await;
    (workers, Producer::connect(&env.amqp_url).await.unwrap())
}

/// Stops the workers and asserts that each one's log says `what`.
fn both_logged(workers: Workers, what: &str, or_else: &str) {
    let logs = workers.stop();
    for i in 0..2 {
        let log = std::fs::read_to_string(logs.join(format!("worker-{i}.log"))).unwrap();
        assert!(log.contains(what), "worker {i} {or_else}");
    }
    common::chaos::remove_logs(&logs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_rate_and_the_budget_hold_across_two_worker_processes() {
    let primary = mock(MockOptions::default()).await;
    let (config, file) = config(&config_with_owners(
        &primary.base_url(),
        "rate = 20\nburst = 1",
    ));
    let env = TestEnv::new(&config).await;
    let (workers, producer) =
        two_workers(&env, &file.path, "warn,onejob::roles::intake=info").await;

    // Forty intents at once, taken by both workers' intakes.
    let intents: Vec<_> = (0..40)
        .map(|i| common::intent("acct_r", &format!("r-{i}"), "paced"))
        .collect();
    let receipts = join_all(intents.iter().map(|i| producer.submit(i))).await;
    let mut jobs = Vec::new();
    for r in receipts {
        let r = r.unwrap();
        assert_eq!(r.outcome, Outcome::Created, "{r:?}");
        jobs.push(r.job_id.unwrap());
    }
    for job in &jobs {
        wait_for_status(&env, *job, JobStatus::Succeeded).await;
    }
    paced_across_both(&env).await;

    // A budget of one job's reservation: the owner's first job takes it all,
    // and once it has spent part of it both workers refuse its new intents.
    let one = common::intent("acct_b", "b-0", "spend");
    let budget = onejob::shared::runtime::new_job(&config, &serde_json::to_vec(&one).unwrap())
        .unwrap()
        .reserve
        .to_string();
    env.cli_ok(
        &file.path,
        &[
            "owners",
            "set",
            "acct_b",
            "--daily-tokens",
            &budget,
            "--reason",
            "test",
        ],
    );
    let first = common::submit(&producer, "acct_b", "b-0", "spend").await;
    wait_for_status(&env, first, JobStatus::Succeeded).await;
    let intents: Vec<_> = (1..=8)
        .map(|i| common::intent("acct_b", &format!("b-{i}"), "more"))
        .collect();
    let refused = join_all(intents.iter().map(|i| producer.submit(i))).await;
    for r in refused {
        let r = r.unwrap();
        assert_eq!(r.outcome, Outcome::Rejected, "{r:?}");
        assert!(r.error.unwrap_or_default().starts_with("budget_exceeded:"));
    }
    producer.close().await;
    both_logged(
        workers,
        "job created",
        "admitted none of the owner's intents",
    );
}

/// The owner's forty first attempts were due at least 1/rate apart, whichever
/// worker admitted them, and none started before it was due.
async fn paced_across_both(env: &TestEnv) {
    let rows: Vec<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT a.not_before, a.started_at FROM attempts a JOIN jobs j ON j.id = a.job_id
             WHERE j.owner_id = 'acct_r' AND a.number = 1 ORDER BY a.not_before",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(rows.len(), 40);
    for pair in rows.windows(2) {
        let apart = (pair[1].0 - pair[0].0).num_microseconds().unwrap();
        assert!(apart >= 49_999, "two first attempts due {apart} µs apart");
    }
    for (due, started) in &rows {
        assert!(started >= due, "started {started} before its turn {due}");
    }
}

/// Two workers call for one owner whose `max_in_flight` is 3: its attempts
/// started at once never pass 3 across both, and both workers call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_in_flight_holds_across_two_worker_processes() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(300),
        ..MockOptions::default()
    })
    .await;
    let (config, file) = config(&config_with_owners(
        &primary.base_url(),
        "max_in_flight = 3",
    ));
    let env = TestEnv::new(&config).await;
    let (workers, producer) =
        two_workers(&env, &file.path, "warn,onejob::roles::attempts=info").await;
    let jobs = super::in_flight::flood(&producer, "acct_m", 16).await;
    for job in &jobs {
        wait_for_status(&env, *job, JobStatus::Succeeded).await;
    }
    assert_eq!(super::in_flight::most_at_once(&env, "acct_m").await, 3);
    producer.close().await;
    both_logged(
        workers,
        "attempt succeeded",
        "called for none of the owner's jobs",
    );
}
