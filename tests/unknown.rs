//! A timeout is `unknown`, not failed: the provider may still be working, so
//! nothing new starts until an operator (or evidence) resolves it.

use onejob_test_support as common;

use std::path::Path;
use std::time::Duration;

use common::{TestEnv, config, config_text, mock, submit, wait_for_status};
use onejob::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use onejob::mock::{MockHandle, MockOptions};
use onejob::settings::config::Config;
use onejob_producer::Producer;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_blocks_the_job_until_an_operator_resolves_it() {
    // The primary answers after 3s; its timeout is 1s.
    let primary = mock(MockOptions {
        delay: Duration::from_secs(3),
        ..MockOptions::default()
    })
    .await;
    let fallback = mock(MockOptions::default()).await;
    let (config, file) = config(&config_text(
        &primary.base_url(),
        Some(&fallback.base_url()),
        "",
    ));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job_id = submit(&producer, "acct_t", "k", "slow").await;
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    assert_eq!(job.attempts.len(), 1);
    let first = job.attempts[0].clone();
    assert_eq!(
        first.status,
        AttemptStatus::Unknown,
        "a timeout is never `failed`"
    );
    assert!(
        first
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("outcome_unknown: timed out"),
        "{:?}",
        first.error
    );

    nothing_starts_beside_the_unknown(&env, &fleet.ctx, &config, job_id, &fallback).await;
    assert_eq!(primary.stats.requests(), 1);

    // The operator learns the provider dropped it, and resolves it as failed.
    primary.configure(|o| o.delay = Duration::ZERO);
    let out = env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &first.id.to_string(),
            "--as",
            "failed",
            "--json",
        ],
    );
    let resolved: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(resolved["resolved_as"], "failed");
    assert!(resolved["next_attempt"].is_string(), "{resolved}");
    assert_eq!(resolved["published"], true);

    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 2);
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    assert_eq!(job.attempts[1].status, AttemptStatus::Succeeded);
    // The fallback is not qualified, so the route rule wrapped around to the primary.
    assert_eq!(job.attempts[1].provider, "primary");
    assert_eq!(fallback.stats.requests(), 0);

    refusals_name_their_reason(&env, &file.path, first.id);

    producer.close().await;
    fleet.stop().await;
}

/// The unknown job `job_id` stays as it is while time passes and sweeps run.
async fn nothing_starts_beside_the_unknown(
    env: &TestEnv,
    fleet: &onejob::shared::runtime::Context,
    config: &Config,
    job_id: JobId,
    fallback: &MockHandle,
) {
    // For three full backoff periods (at their cap) plus the vanished-worker grace,
    // and through three whole runs of each reconciler sweep (the vanished-worker, lost-message
    // and hedging passes, each a chance to start something beside the unknown),
    // nothing new starts and nobody calls the fallback.
    let window = config.worker.retry_backoff_max * 3 + config.worker.vanished_grace;
    common::through_sweeps(fleet, 3, window, "the unknown job's window", || async {
        let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
        assert_eq!(job.status, JobStatus::Unknown);
        assert_eq!(job.attempts.len(), 1, "no new attempt while one is unknown");
        assert_eq!(
            job.attempts[0].status,
            AttemptStatus::Unknown,
            "never failed by time alone"
        );
        assert_eq!(fallback.stats.requests(), 0, "the fallback is never called");
    })
    .await;
}

/// The CLI's refusals: resolving a terminal attempt or one that does not
/// exist (exit 1, with the reason), and bad usage (exit 2).
fn refusals_name_their_reason(env: &TestEnv, path: &Path, first: AttemptId) {
    // Resolving a terminal attempt is refused with exit 1 and the reason.
    let out = env.cli(
        path,
        &["attempts", "resolve", &first.to_string(), "--as", "failed"],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already failed"));
    // An attempt that does not exist: exit 1. Bad usage: exit 2.
    let out = env.cli(
        path,
        &[
            "attempts",
            "resolve",
            &uuid::Uuid::now_v7().to_string(),
            "--as",
            "failed",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    let out = env.cli(
        path,
        &["attempts", "resolve", &first.to_string(), "--as", "maybe"],
    );
    assert_eq!(out.status.code(), Some(2));
    let out = env.cli(path, &["jobs", "show", "not-a-uuid"]);
    assert_eq!(out.status.code(), Some(2));
    let out = env.cli(path, &["jobs", "show", &uuid::Uuid::now_v7().to_string()]);
    assert_eq!(out.status.code(), Some(1));
}

/// A connection lost after the request was sent is `unknown` too; resolving it as
/// cancelled ends the job, with one `job.cancelled` event.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_connection_is_unknown_and_can_be_cancelled() {
    let primary = mock(MockOptions::default()).await;
    let (config, file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let amqp = env.amqp().await;
    let (events, events_queue) = env.watch_events(&amqp).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job_id = submit(&producer, "acct_d", "k", "mock:drop").await;
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let attempt = &job.attempts[0];
    assert_eq!(attempt.status, AttemptStatus::Unknown);
    assert!(
        attempt
            .error
            .as_deref()
            .unwrap_or("")
            .contains("connection lost after the request was sent"),
        "{:?}",
        attempt.error
    );

    env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &attempt.id.to_string(),
            "--as",
            "cancelled",
        ],
    );
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Cancelled);
    assert_eq!(job.version, 1);

    // One event: the outbox all published and the relay run twice more, no
    // second copy came.
    let got = common::events_once_settled(&env, &fleet.ctx, &events, &events_queue).await;
    assert_eq!(got.len(), 1, "one event, no second");
    assert_eq!(got[0].routing_key.as_str(), "job.cancelled");

    // A cancelled job never changes again.
    let out = env.cli(
        &file.path,
        &[
            "attempts",
            "resolve",
            &attempt.id.to_string(),
            "--as",
            "failed",
        ],
    );
    assert_eq!(out.status.code(), Some(1));

    producer.close().await;
    fleet.stop().await;
}
