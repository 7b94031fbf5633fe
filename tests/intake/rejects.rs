//! What intake refuses: every bad intent with its specific reason, dead-lettered,
//! and a receipt to a queue it was not allowed to name.

use lapin::options::BasicPublishOptions;
use onejob::broker;
use onejob::broker::header_str;
use onejob::fleet::Role;
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use crate::common::{TestEnv, config, config_text, intent, mock, wait_for_messages};

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
        (r#"{"owner_id":"a","idempotency_key":"k","operation":"summarize","input":{"txt":"x"}}"#.into(), "bad_input"),
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

/// Receipts go only to direct reply-to, a queue the broker named
/// (`amq.gen-…`) or a queue `worker.reply_queues` names: a publisher naming
/// another queue (onejob's own attempts queue, another service's, another
/// `amq.` name) would otherwise have the worker publish a message of its
/// choice there with the worker's own permissions. Each such intent is
/// dead-lettered with the reason and gets no receipt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn receipts_go_only_to_direct_reply_to_a_server_named_or_an_allowed_queue() {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let text = config_text("http://127.0.0.1:9/v1", None, "")
        .replace("[worker]\n", "[worker]\nreply_queues = [\"svc.replies\"]\n");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![Role::Intake]).await;
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.queue_declare(
        "svc.replies".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let attempts = broker::attempts_queue("primary");
    let forbidden = [
        attempts.as_str(),
        broker::INTENTS_QUEUE,
        "onejob.events",
        "amq.direct",
        "amq.rabbitmq.trace",
        "amq.gen-",
        "amq.gen",
        "amq.genx-abc",
        "amq.gen-abc.def",
        "amq.gen-abc\u{7f}",
    ];
    let mut sends: Vec<(String, &str)> = forbidden
        .iter()
        .enumerate()
        .map(|(i, q)| (format!("k-forged-{i}"), *q))
        .collect();
    sends.push(("k-allowed".into(), "svc.replies"));
    for (key, reply_to) in &sends {
        publish_asking(&ch, key, reply_to, key).await;
    }
    let mut refused = refused_names(&env, &ch, forbidden.len()).await;
    refused.sort();
    let mut expected: Vec<String> = forbidden.iter().map(|q| (*q).to_owned()).collect();
    expected.sort();
    assert_eq!(
        refused, expected,
        "each forbidden name refused, and only those"
    );
    let receipt = wait_for_messages(&env, &ch, "svc.replies").await.remove(0);
    assert_eq!(
        receipt
            .properties
            .correlation_id()
            .as_ref()
            .map(|c| c.as_str()),
        Some("k-allowed")
    );
    // The attempts queue holds the allowed intent's first attempt, and no receipt.
    let held = wait_for_messages(&env, &ch, &attempts).await;
    assert_eq!(held.len(), 1);
    assert_eq!(
        held[0].properties.correlation_id(),
        &None,
        "no receipt in onejob's queue"
    );
    for (key, _) in &sends[..forbidden.len()] {
        assert!(
            env.store
                .jobs()
                .find("acct_reply", key)
                .await
                .unwrap()
                .is_none(),
            "{key} made no job"
        );
    }
    fleet.stop().await;
}

/// Publishes an intent with `key` that asks for its receipt at `reply_to`,
/// under `correlation`.
async fn publish_asking(ch: &lapin::Channel, key: &str, reply_to: &str, correlation: &str) {
    let body = serde_json::to_vec(&intent("acct_reply", key, "text")).unwrap();
    ch.basic_publish(
        broker::EXCHANGE.into(),
        broker::INTENTS_KEY.into(),
        BasicPublishOptions::default(),
        &body,
        broker::json_properties()
            .with_reply_to(reply_to.into())
            .with_correlation_id(correlation.into()),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// The `reply_to` of each of the `n` intents dead-lettered as
/// `reply_to_refused`.
async fn refused_names(env: &TestEnv, ch: &lapin::Channel, n: usize) -> Vec<String> {
    let dlq = format!("{}.dlq", broker::INTENTS_QUEUE);
    let mut letters = Vec::new();
    while letters.len() < n {
        letters.extend(wait_for_messages(env, ch, &dlq).await);
    }
    assert_eq!(letters.len(), n, "one letter per forbidden name");
    letters
        .iter()
        .map(|letter| {
            let headers = letter.properties.headers().clone().unwrap_or_default();
            let error = header_str(&headers, broker::ERROR_HEADER).unwrap_or_default();
            assert!(error.starts_with("reply_to_refused"), "{error}");
            letter
                .properties
                .reply_to()
                .as_ref()
                .map(|r| r.to_string())
                .unwrap_or_default()
        })
        .collect()
}

/// A publisher written after RabbitMQ's RPC tutorial: it declares a private
/// queue with an empty name (the broker names it `amq.gen-…`), exclusive to
/// its connection, consumes it, and names it in `reply_to`. Its intents
/// become jobs and its receipts arrive there: `created`, then `duplicate`
/// with the same job for a re-send.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publisher_after_the_rpc_tutorial_gets_its_receipts() {
    use futures_util::StreamExt;
    use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![Role::Intake]).await;
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let callback = ch
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let callback = callback.name().to_string();
    assert!(callback.starts_with("amq.gen-"), "{callback}");
    let mut receipts = ch
        .basic_consume(
            callback.as_str().into(),
            "rpc-client".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut jobs = Vec::new();
    for (n, correlation) in ["c-1", "c-2"].into_iter().enumerate() {
        publish_asking(&ch, "rpc-1", &callback, correlation).await;
        let delivery = tokio::time::timeout(std::time::Duration::from_secs(20), receipts.next())
            .await
            .expect("a receipt within 20 s")
            .expect("the consumer is open")
            .unwrap();
        assert_eq!(
            delivery
                .properties
                .correlation_id()
                .as_ref()
                .map(|c| c.as_str()),
            Some(correlation)
        );
        let receipt: onejob::intent::Receipt = serde_json::from_slice(&delivery.data).unwrap();
        let expected = if n == 0 {
            Outcome::Created
        } else {
            Outcome::Duplicate
        };
        assert_eq!(receipt.outcome, expected, "{receipt:?}");
        jobs.push(receipt.job_id.expect("a job id"));
    }
    assert_eq!(jobs[0], jobs[1], "the re-send names the same job");
    let job = env.store.jobs().find("acct_reply", "rpc-1").await.unwrap();
    assert_eq!(job.map(|j| j.id), Some(jobs[0]));
    let dlq = format!("{}.dlq", broker::INTENTS_QUEUE);
    assert!(
        env.drain(&ch, &dlq).await.is_empty(),
        "nothing dead-lettered"
    );
    fleet.stop().await;
}
