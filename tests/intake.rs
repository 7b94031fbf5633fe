//! Intake on the real broker: every reject reason is specific, lands in the
//! dead-letter queue with its reason, and stops nothing; a crash between commit and
//! ack is a redelivery that comes out as a `duplicate` of the same job.

mod common;

use std::time::Duration;

use common::{
    TestEnv, config, config_text, intent, mock, wait_for, wait_for_messages, wait_for_status,
};
use lapin::options::{BasicGetOptions, BasicPublishOptions};
use onejob::broker;
use onejob::domain::JobStatus;
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob::store::Admission;
use onejob::worker::{Role, header_str};
use onejob_producer::Producer;

const SETTLE: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_bad_intent_is_rejected_with_its_reason_and_dead_lettered() {
    let primary = mock(MockOptions::default()).await;
    let text = config_text(&primary.base_url(), None, "")
        .replace("[worker]\n", "[worker]\nmax_message_bytes = 4096\n");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![Role::Intake]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let long_owner = "o".repeat(129);
    let long_key = "k".repeat(256);
    let huge_text = "x".repeat(5000);
    let cases: Vec<(String, &str)> = vec![
        ("this is not json".into(), "invalid_json"),
        ("[1, 2, 3]".into(), "not_an_object"),
        (r#"{"owner_id":"a","idempotency_key":"k","operation":"summarize","input":{},"priority":1}"#.into(), "unknown_field"),
        (r#"{"owner_id":"a","owner_id":"b","idempotency_key":"k","operation":"summarize","input":{}}"#.into(), "duplicate_field"),
        (r#"{"owner_id":"a","operation":"summarize","input":{}}"#.into(), "missing_field"),
        (r#"{"owner_id":"a","idempotency_key":"k","operation":"summarize","input":"text"}"#.into(), "wrong_type"),
        (r#"{"owner_id":42,"idempotency_key":"k","operation":"summarize","input":{}}"#.into(), "wrong_type"),
        (format!(r#"{{"owner_id":"{long_owner}","idempotency_key":"k","operation":"summarize","input":{{}}}}"#), "bad_length"),
        (format!(r#"{{"owner_id":"a","idempotency_key":"{long_key}","operation":"summarize","input":{{}}}}"#), "bad_length"),
        (r#"{"owner_id":"a b","idempotency_key":"k","operation":"summarize","input":{}}"#.into(), "bad_characters"),
        (r#"{"owner_id":"a","idempotency_key":"k","operation":"translate","input":{}}"#.into(), "unknown_operation"),
        (r#"{"owner_id":"a","idempotency_key":"k","operation":"summarize","input":{},"provider":"nope"}"#.into(), "provider_not_in_route"),
        (format!(r#"{{"owner_id":"a","idempotency_key":"k","operation":"summarize","input":{{"text":"{huge_text}"}}}}"#), "too_large"),
    ];
    for (body, code) in &cases {
        let receipt = producer.submit_raw(body.as_bytes()).await.unwrap();
        assert_eq!(receipt.outcome, Outcome::Rejected, "{code}");
        assert_eq!(receipt.job_id, None);
        let error = receipt.error.unwrap_or_default();
        assert!(error.starts_with(code), "expected {code}, got {error}");
    }
    let mut bad_utf8 =
        br#"{"owner_id":"a","idempotency_key":"k","operation":"summarize","input":{"t":""#.to_vec();
    bad_utf8.extend_from_slice(&[0xff, 0xfe]);
    bad_utf8.extend_from_slice(br#""}}"#);
    let receipt = producer.submit_raw(&bad_utf8).await.unwrap();
    assert!(receipt.error.unwrap_or_default().starts_with("not_utf8"));

    // The worker carried on: a good intent is still accepted.
    let good = producer
        .submit(&intent("acct_i", "good", "fine"))
        .await
        .unwrap();
    assert_eq!(good.outcome, Outcome::Created);

    // Each rejected message sits in the dead-letter queue, body intact, with the
    // reason in x-onejob-error and its original routing.
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    let dlq = broker::dead_letter_queue(broker::INTENTS_QUEUE);
    let dead = env.drain(&ch, &dlq).await;
    assert_eq!(dead.len(), cases.len() + 1);
    for (d, (body, code)) in dead.iter().zip(&cases) {
        assert_eq!(d.data, body.as_bytes());
        let headers = d.properties.headers().clone().unwrap_or_default();
        let reason = header_str(&headers, broker::ERROR_HEADER).unwrap_or_default();
        assert!(reason.starts_with(code), "{code}: {reason}");
        assert_eq!(
            header_str(&headers, "x-onejob-original-routing-key").as_deref(),
            Some("intents")
        );
    }
    let (jobs,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, 1, "no rejected intent became a job");

    producer.close().await;
    fleet.stop().await;
}

/// The worker commits the job, then dies before acking. The broker redelivers; the
/// next worker answers `duplicate` with the same job id, and the first attempt's
/// message, never published by the dead worker, is relayed from the outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_between_commit_and_ack_is_a_duplicate_of_the_same_job() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let pending = {
        let producer = std::sync::Arc::new(producer);
        let p = producer.clone();
        (
            tokio::spawn(async move { p.submit(&intent("acct_x", "crash", "survive")).await }),
            producer,
        )
    };

    // The doomed worker: takes the intent, commits the job, never acks.
    let doomed = env.amqp().await;
    let ch = doomed.create_channel().await.unwrap();
    let got = wait_for("the intent to arrive", SETTLE, || async {
        ch.basic_get(
            broker::INTENTS_QUEUE.into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
    })
    .await;
    assert!(!got.delivery.redelivered);
    let new_job = onejob::intake::validate(&ctx, &got.delivery.data).expect("valid intent");
    let created = match ctx.store.admit(&[new_job]).await.unwrap().remove(0) {
        Admission::Created { job_id, .. } => job_id,
        other => panic!("expected created, got {other:?}"),
    };
    // kill -9: the connection goes away with the delivery unacked (closing the
    // connection closes its channel; the broker requeues what it had not acked).
    doomed.close(320, "simulated crash".into()).await.unwrap();
    drop(ch);

    let fleet = env.fleet(config.clone(), vec![]).await;
    let receipt = pending.0.await.unwrap().unwrap();
    assert_eq!(
        receipt.outcome,
        Outcome::Duplicate,
        "the redelivery is a duplicate"
    );
    assert_eq!(
        receipt.job_id,
        Some(created),
        "naming the job the crashed worker created"
    );

    // The first attempt was committed with the job; its message is relayed once the
    // dead worker's lease on the outbox row runs out, and the job completes.
    let job = wait_for_status(&env, created, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1);
    let (jobs,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, 1);

    // A malformed attempt message is dead-lettered with its reason, not looped.
    let ch = ctx.connection.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.basic_publish(
        broker::EXCHANGE.into(),
        broker::attempts_routing_key("primary").as_str().into(),
        BasicPublishOptions::default(),
        br#"{"attempt":"nope"}"#,
        broker::json_properties(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let dlq = broker::dead_letter_queue(&broker::attempts_queue("primary"));
    let dead = wait_for_messages(&env, &ch, &dlq).await;
    let headers = dead[0].properties.headers().clone().unwrap_or_default();
    assert!(
        header_str(&headers, broker::ERROR_HEADER)
            .unwrap_or_default()
            .starts_with("malformed_attempt_message")
    );

    std::sync::Arc::try_unwrap(pending.1).unwrap().close().await;
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}
