//! The main path, end to end through the real RabbitMQ and Postgres: one intent
//! becomes one job, however often it is sent.

use onejob_test_support as common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{TestEnv, config, config_text, intent, mock, submit, wait_for_status};
use futures_util::future::join_all;
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_published_intent_becomes_one_succeeded_job() {
    let primary = mock(MockOptions::default()).await;
    let (config, file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let amqp = env.amqp().await;
    let (events, events_queue) = env.watch_events(&amqp).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let receipt = producer
        .submit(&intent("acct_1", "k-1", "the quick fox"))
        .await
        .unwrap();
    assert_eq!(receipt.outcome, Outcome::Created);
    assert_eq!(receipt.error, None);
    let job_id = receipt.job_id.expect("a created receipt names its job");

    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.version, 1, "one write of the outcome");
    assert_eq!(job.attempts.len(), 1);
    let attempt = &job.attempts[0];
    assert_eq!(attempt.status, AttemptStatus::Succeeded);
    assert_eq!(attempt.provider, "primary");
    assert_eq!(job.completed_by, Some(attempt.id));
    assert_eq!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: the quick fox")
    );
    assert!(
        attempt
            .usage
            .as_ref()
            .is_some_and(|u| u["total_tokens"].as_u64() > Some(0))
    );
    assert_eq!(
        attempt.provider_request_id.as_deref(),
        Some("chatcmpl-mock-1")
    );
    // The provider saw the attempt id as its Idempotency-Key, once.
    assert_eq!(
        primary.stats.idempotency_keys(),
        vec![attempt.id.to_string()]
    );

    // Exactly one job.succeeded event, identified by job id and version: the
    // outbox all published, and the relay run twice more, no second copy came.
    let got = common::events_once_settled(&env, &fleet.ctx, &events, &events_queue).await;
    assert_eq!(got.len(), 1, "one event, no second");
    assert_eq!(got[0].routing_key.as_str(), "job.succeeded");
    let event: serde_json::Value = serde_json::from_slice(&got[0].data).unwrap();
    assert_eq!(event["event_id"], format!("{job_id}:1"));
    assert_eq!(event["result"], job.result.clone().unwrap());

    // Operators see it through the CLI.
    let out = env.cli_ok(&file.path, &["jobs", "show", &job_id.to_string()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("succeeded") && text.contains("usage"),
        "{text}"
    );
    let out = env.cli(
        &file.path,
        &[
            "jobs", "find", "--owner", "acct_1", "--key", "k-1", "--json",
        ],
    );
    assert!(out.status.success());
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["id"], job_id.to_string());
    assert_eq!(shown["attempts"][0]["status"], "succeeded");

    producer.close().await;
    fleet.stop().await;
}

/// Two publishers on separate connections send the same 50 intents at the same
/// moment, three rounds over. Every pair of receipts names one job; exactly one of
/// each pair says `created`; the table holds one row per identity, each with one
/// attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn double_click_makes_one_job_per_identity() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let a = Arc::new(Producer::connect(&env.amqp_url).await.unwrap());
    let b = Arc::new(Producer::connect(&env.amqp_url).await.unwrap());

    for round in 0..3 {
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let send = |producer: Arc<Producer>, barrier: Arc<tokio::sync::Barrier>| async move {
            barrier.wait().await;
            join_all((0..50).map(|i| {
                let producer = producer.clone();
                async move {
                    let key = format!("click-{round}-{i}");
                    let receipt = producer
                        .submit(&intent("acct_dc", &key, "same text"))
                        .await
                        .unwrap();
                    (key, receipt)
                }
            }))
            .await
        };
        let (ra, rb) = tokio::join!(
            tokio::spawn(send(a.clone(), barrier.clone())),
            tokio::spawn(send(b.clone(), barrier.clone()))
        );
        let rb: HashMap<_, _> = rb.unwrap().into_iter().collect();
        for (key, first) in ra.unwrap() {
            let second = &rb[&key];
            assert!(first.job_id.is_some(), "{key}: {first:?}");
            assert_eq!(
                first.job_id, second.job_id,
                "{key}: both receipts name one job"
            );
            let created = [first.outcome, second.outcome]
                .iter()
                .filter(|o| **o == Outcome::Created)
                .count();
            assert_eq!(
                created, 1,
                "{key}: exactly one created ({:?}, {:?})",
                first.outcome, second.outcome
            );
            assert!([first.outcome, second.outcome].contains(&Outcome::Duplicate));
        }
    }

    let (jobs, identities, attempts): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM jobs), (SELECT count(DISTINCT (owner_id, idempotency_key)) FROM jobs),
                (SELECT count(*) FROM attempts)",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert_eq!((jobs, identities), (150, 150));
    assert_eq!(attempts, 150, "one first attempt per job, no more");

    Arc::try_unwrap(a).unwrap().close().await;
    Arc::try_unwrap(b).unwrap().close().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn same_key_different_input_is_a_conflict() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let first = producer
        .submit_raw(br#"{"owner_id":"acct_c","idempotency_key":"k","operation":"summarize","input":{"text":"a","n":[1,{"x":1,"y":2}]}}"#)
        .await
        .unwrap();
    assert_eq!(first.outcome, Outcome::Created);
    let before = env.store.jobs().find("acct_c", "k").await.unwrap().unwrap();

    let conflict = producer
        .submit_raw(br#"{"owner_id":"acct_c","idempotency_key":"k","operation":"summarize","input":{"text":"b","n":[1,{"x":1,"y":2}]}}"#)
        .await
        .unwrap();
    assert_eq!(conflict.outcome, Outcome::Conflict);
    assert_eq!(
        conflict.job_id, None,
        "a conflict never hands out the existing job"
    );
    assert_eq!(conflict.error, None);

    // Pinning a provider changes the intent too.
    let pinned = producer
        .submit_raw(br#"{"owner_id":"acct_c","idempotency_key":"k","operation":"summarize","input":{"text":"a","n":[1,{"x":1,"y":2}]},"provider":"primary"}"#)
        .await
        .unwrap();
    assert_eq!(pinned.outcome, Outcome::Conflict);

    // Same intent, keys reordered and whitespace changed: a duplicate.
    let reordered = producer
        .submit_raw(b"{ \"input\" : { \"n\": [1, {\"y\": 2,\n \"x\": 1}], \"text\": \"a\" },\n  \"operation\": \"summarize\", \"idempotency_key\": \"k\", \"owner_id\": \"acct_c\" }")
        .await
        .unwrap();
    assert_eq!(reordered.outcome, Outcome::Duplicate);
    assert_eq!(reordered.job_id, first.job_id);

    let after = env.store.jobs().find("acct_c", "k").await.unwrap().unwrap();
    assert_eq!(after.id, before.id);
    assert_eq!(
        after.input, before.input,
        "the conflicting intent changed nothing"
    );
    assert_eq!(after.request_fingerprint, before.request_fingerprint);
    assert_eq!(after.version, before.version);
    assert_eq!(after.updated_at, before.updated_at);
    assert_eq!(after.attempts.len(), 1);

    // Another owner may use the same key.
    let other = producer
        .submit_raw(br#"{"owner_id":"acct_other","idempotency_key":"k","operation":"summarize","input":{"text":"b"}}"#)
        .await
        .unwrap();
    assert_eq!(other.outcome, Outcome::Created);
    assert_ne!(other.job_id, first.job_id);

    producer.close().await;
    fleet.stop().await;
}

/// Answers that break the output contract are definite failures, retried on the
/// route until `max_attempts`, then the job fails with the last error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contract_violations_fail_attempts_and_then_the_job() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    for (key, directive, expect) in [
        (
            "prose",
            "mock:prose",
            "contract_violation: content is not JSON",
        ),
        ("extra", "mock:extra_key", "contract_violation"),
        ("type", "mock:wrong_type", "contract_violation: at /summary"),
        ("status", "mock:status=503", "provider_error: HTTP 503"),
    ] {
        let receipt = producer
            .submit(&intent("acct_v", key, directive))
            .await
            .unwrap();
        let job_id = receipt.job_id.unwrap();
        let job = wait_for_status(&env, job_id, JobStatus::Failed).await;
        assert_eq!(job.attempts.len(), 3, "{key}: max_attempts attempts in all");
        assert!(
            job.attempts
                .iter()
                .all(|a| a.status == AttemptStatus::Failed)
        );
        let error = job.error.unwrap_or_default();
        assert!(error.starts_with(expect), "{key}: {error}");
        assert_eq!(job.result, None);
        assert_eq!(job.version, 1);
        // Backoff is persisted: each retry was not to be published before its time.
        for pair in job.attempts.windows(2) {
            assert!(
                pair[1].not_before >= pair[0].finished_at.unwrap(),
                "{key}: backoff kept"
            );
        }
    }

    producer.close().await;
    fleet.stop().await;
}

/// A provider that refuses connections never saw the request: a definite failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_refused_is_a_definite_failure() {
    let refusing = common::refusing::RefusingPort::new();
    let (config, _file) = config(&config_text(&refusing.provider_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_r", "k", "x").await;
    let job = wait_for_status(&env, job_id, JobStatus::Failed).await;
    assert_eq!(job.attempts.len(), 3);
    assert!(
        job.error
            .unwrap_or_default()
            .starts_with("provider_unreachable")
    );
    assert!(
        job.attempts
            .iter()
            .all(|a| a.status == AttemptStatus::Failed && a.usage.is_none())
    );
    producer.close().await;
    fleet.stop().await;
}
