//! The pass over idempotency keys: a replayed answer, a `409` (still being
//! processed: looked at again), and a discarded attempt that is never sent
//! again.

use std::time::Duration;

use crate::common::{self, TestEnv, config, intent, mock, wait_for, wait_for_status};
use onejob::domain::{AttemptId, AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use super::{evidence_rows, replay_config};

/// With `idempotency_key` evidence, an unknown call is sent again with the
/// same key: while the first call still runs the provider answers `409`
/// (still being processed) and the pass looks again later; then it answers
/// with the first call's answer and runs nothing new, and that answer settles
/// the attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repeated_key_settles_an_unknown_with_the_first_answer() {
    // The first look comes at the timeout plus the delay (1.5 s), while the
    // call still runs.
    let slow = mock(MockOptions {
        replay: true,
        delay: Duration::from_secs(3),
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
    assert!(
        slow.stats.requests() >= 3,
        "sent again while the first ran (409), and after: {}",
        slow.stats.requests()
    );
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

/// A `409` for the key means the first request is still being processed
/// (the IETF Idempotency-Key draft): the attempt is looked at again, never
/// failed on it, until `evidence_deadline`; then it waits for an operator,
/// still `unknown`, and no new work ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_409_is_looked_at_again_until_the_deadline_then_waits_for_an_operator() {
    let endless = mock(MockOptions {
        replay: true,
        delay: Duration::from_secs(60),
        ..MockOptions::default()
    })
    .await;
    let text = replay_config(&endless.base_url()).replace(
        "evidence_delay = \"1s\"",
        "evidence_delay = \"1s\"\nevidence_deadline = \"4s\"",
    );
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-409", "still running"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let attempt = job.attempts[0].id;
    let note = wait_for_note(&env, attempt, "waits for an operator").await;
    assert!(note.contains("409"), "{note}");
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown, "{job:?}");
    assert_eq!(job.attempts.len(), 1, "no next attempt: {job:?}");
    assert_eq!(job.attempts[0].status, AttemptStatus::Unknown);
    assert_eq!(endless.stats.work(), 1, "no new work");
    assert!(endless.stats.requests() >= 2, "sent again");
    assert!(
        evidence_rows(&env, job_id).await.is_empty(),
        "nothing resolved"
    );
    producer.close().await;
    fleet.stop().await;
}

/// An unknown attempt discarded because a hedge won is never sent again: a
/// re-send could buy new work for a job that is over, if the first request
/// never reached the provider or its key expired. (An operator's look sends
/// it once while it is unknown; once it is discarded, the pass, made due at
/// once, writes why it sends nothing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_discarded_attempt_is_never_sent_again() {
    let endless = mock(MockOptions {
        replay: true,
        delay: Duration::from_secs(60),
        ..MockOptions::default()
    })
    .await;
    let hedge = mock(MockOptions {
        delay: Duration::from_secs(4),
        ..MockOptions::default()
    })
    .await;
    // The hedge starts (the hedging pass runs every second) before the
    // primary's timeout; the pass's own looks wait a minute at least.
    let text = common::config_for(
        &[
            common::P(
                "primary",
                &endless.base_url(),
                "timeout = \"2s\"\nevidence = \"idempotency_key\"\nevidence_delay = \"5m\"",
            ),
            common::P("fallback", &hedge.base_url(), "timeout = \"10s\""),
        ],
        "hedge_after = \"200ms\"",
    );
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    env.cli_ok(&file.path, &["providers", "qualify", "fallback"]);
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-discard", "hedged"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let primary = job.attempts[0].id;
    let out = env.cli_ok(
        &file.path,
        &[
            "attempts",
            "evidence",
            &primary.to_string(),
            "--reason",
            "look",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("still processing"), "{text}");
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded, "{job:?}");
    let requests = endless.stats.requests();
    assert_eq!(requests, 2, "the call, and the operator's look");
    sqlx::query("UPDATE attempts SET evidence_next_at = now() WHERE id = $1")
        .bind(primary.0)
        .execute(env.store.pool())
        .await
        .unwrap();
    let note = wait_for_note(&env, primary, "never sent again").await;
    assert!(note.contains("discarded"), "{note}");
    assert_eq!(endless.stats.requests(), requests, "not sent again");
    assert_eq!(endless.stats.work(), 1);
    producer.close().await;
    fleet.stop().await;
}

/// Waits for `attempt`'s evidence note to hold `words`, and returns it.
async fn wait_for_note(env: &TestEnv, attempt: AttemptId, words: &str) -> String {
    wait_for(
        &format!("an evidence note saying {words:?}"),
        Duration::from_secs(30),
        || async {
            let note: Option<String> =
                sqlx::query_scalar("SELECT evidence_note FROM attempts WHERE id = $1")
                    .bind(attempt.0)
                    .fetch_one(env.store.pool())
                    .await
                    .unwrap();
            note.filter(|n| n.contains(words))
        },
    )
    .await
}
