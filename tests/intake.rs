//! Intake on the real broker: every reject reason is specific, lands in the
//! dead-letter queue with its reason, and stops nothing; a crash between commit and
//! ack is a redelivery that comes out as a `duplicate` of the same job.

mod common;

use std::time::Duration;

use common::{
    TestEnv, config, config_text, intent, mock, new_job, wait_for, wait_for_messages,
    wait_for_status,
};
use lapin::options::{BasicGetOptions, BasicPublishOptions};
use onejob::broker;
use onejob::broker::header_str;
use onejob::domain::JobStatus;
use onejob::fleet::Role;
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob::store::Admission;
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

/// What an admission says, with the job it names.
fn said(a: &Admission) -> (&'static str, Option<onejob::domain::JobId>) {
    match a {
        Admission::Created { job_id, .. } => ("created", Some(*job_id)),
        Admission::Duplicate { job_id } => ("duplicate", Some(*job_id)),
        Admission::Conflict => ("conflict", None),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_batch_settles_each_identity_once_even_when_batches_race() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;

    onejob::metrics::install();
    // Within one statement: the same identity three times, another twice, out
    // of order (the store sorts by identity; answers come back in this order).
    let batch = [
        new_job("acct_b", "b", "two"),
        new_job("acct_b", "a", "one"),
        new_job("acct_b", "a", "other"),
        new_job("acct_b", "a", "one"),
        new_job("acct_b", "b", "two"),
    ];
    let admitted = env.store.admit(&batch).await.unwrap();
    let got: Vec<_> = admitted.iter().map(said).collect();
    let (a, b) = (batch[1].job_id, batch[0].job_id);
    assert_eq!(
        got,
        [
            ("created", Some(b)),
            ("created", Some(a)),
            ("conflict", None),
            ("duplicate", Some(a)),
            ("duplicate", Some(b)),
        ]
    );

    // The same call run again after its commit went through unseen (the
    // connection dropped at COMMIT): still `created`, with the outbox row that
    // the first run wrote, not a `duplicate` of itself.
    let again = env.store.admit(&batch[..2]).await.unwrap();
    match &again[..] {
        [
            Admission::Created {
                job_id: jb,
                publish: pb,
            },
            Admission::Created {
                job_id: ja,
                publish: pa,
            },
        ] => {
            assert_eq!((*jb, *ja), (b, a));
            assert_eq!(pb.message_id, batch[0].attempt_id.to_string());
            assert_eq!(pa.message_id, batch[1].attempt_id.to_string());
        }
        other => panic!("{other:?}"),
    }
    // Anyone else with the same intent is told `duplicate`.
    let other = env
        .store
        .admit(&[new_job("acct_b", "a", "one")])
        .await
        .unwrap();
    assert_eq!(said(&other[0]), ("duplicate", Some(a)));

    // Batches that overlap, racing on separate connections, round after round.
    for round in 0..20 {
        let keys: Vec<String> = (0..10).map(|k| format!("r{round}-{k}")).collect();
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(3));
        let racers = (0..3).map(|racer| {
            let store = env.store.clone();
            let barrier = barrier.clone();
            // Each racer sends the same keys in its own order.
            let mut mine: Vec<_> = keys.iter().map(|k| new_job("acct_r", k, "same")).collect();
            mine.rotate_left(racer * 3);
            tokio::spawn(async move {
                barrier.wait().await;
                let admitted = store.admit(&mine).await.unwrap();
                mine.iter()
                    .zip(admitted)
                    .map(|(n, a)| (n.intent.idempotency_key.clone(), said(&a)))
                    .collect::<Vec<_>>()
            })
        });
        let mut by_key: std::collections::HashMap<String, Vec<(&str, Option<_>)>> =
            std::collections::HashMap::new();
        for racer in futures_util::future::join_all(racers).await {
            for (key, answer) in racer.unwrap() {
                by_key.entry(key).or_default().push(answer);
            }
        }
        for (key, answers) in by_key {
            let created = answers.iter().filter(|a| a.0 == "created").count();
            let jobs: std::collections::BTreeSet<_> = answers.iter().map(|a| a.1).collect();
            assert_eq!(created, 1, "round {round}, {key}: {answers:?}");
            assert_eq!(jobs.len(), 1, "round {round}, {key}: one job named by all");
        }
    }
    let (jobs, identities): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT (owner_id, idempotency_key)) FROM jobs")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!((jobs, identities), (2 + 20 * 10, 2 + 20 * 10));
    // Overlapping batches insert in one order, so none deadlocked (a deadlock
    // would have been retried, and counted).
    let metrics = onejob::metrics::render();
    assert!(
        !metrics.contains(r#"onejob_db_retries_total{code="40P01"}"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_the_database_refuses_fails_only_the_refused_intent() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    // Validation refuses NUL, which Postgres cannot store; this intent skips
    // validation to stand for any data the database refuses.
    let mut refused = new_job("acct_n", "bad", "x");
    refused.intent.input.insert(
        "text".into(),
        serde_json::Value::String("nul \u{0} here".into()),
    );
    let batch = [
        new_job("acct_n", "good-1", "x"),
        refused,
        new_job("acct_n", "good-2", "x"),
    ];
    let rows = onejob::intake::admit_rows(&ctx, &onejob::shutdown::Shutdown::new(), &batch).await;
    let got: Vec<&str> = rows
        .iter()
        .map(|r| match r {
            Some(Ok(a)) => said(a).0,
            Some(Err(reason)) if reason.to_string().starts_with("unstorable") => "unstorable",
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(got, ["created", "unstorable", "created"]);
    let (jobs,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, 2);
    let _ = ctx.connection.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_is_admitted_in_batches_with_every_receipt_right() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    // The receipts wait while the backlog builds up and the fleet starts.
    let options = onejob_producer::ProducerOptions {
        receipt_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let producer = std::sync::Arc::new(
        Producer::connect_with(&env.amqp_url, options)
            .await
            .unwrap(),
    );

    // 300 intents wait in the queue before intake starts: 200 keys, 70 of them
    // sent again (the same intent) and 20 with a different one, plus 10 invalid.
    let mut sends: Vec<(String, Vec<u8>)> = (0..200)
        .map(|k| (format!("k{k}"), format!("text {k}")))
        .chain((0..70).map(|k| (format!("k{k}"), format!("text {k}"))))
        .chain((100..120).map(|k| (format!("k{k}"), "changed".to_owned())))
        .map(|(key, text)| {
            let body = serde_json::to_vec(&intent("acct_q", &key, &text)).unwrap();
            (key, body)
        })
        .collect();
    sends.extend((0..10).map(|i| (format!("bad{i}"), format!("{{\"bad\":{i}}}").into_bytes())));
    let waiting: Vec<_> = sends
        .into_iter()
        .map(|(key, body)| {
            let producer = producer.clone();
            tokio::spawn(async move { (key, producer.submit_raw(&body).await.unwrap()) })
        })
        .collect();
    let ch = ctx.connection.create_channel().await.unwrap();
    wait_for("the backlog to be queued", SETTLE, || async {
        (common::depth(&ch, broker::INTENTS_QUEUE).await == 300).then_some(())
    })
    .await;

    let fleet = env.fleet(config.clone(), vec![Role::Intake]).await;
    let mut outcomes: std::collections::HashMap<&str, usize> = Default::default();
    let mut job_of: std::collections::HashMap<String, onejob::domain::JobId> = Default::default();
    for task in waiting {
        let (key, receipt) = task.await.unwrap();
        *outcomes.entry(receipt.outcome.as_str()).or_default() += 1;
        if let Some(job) = receipt.job_id {
            let first = *job_of.entry(key.clone()).or_insert(job);
            assert_eq!(first, job, "{key}: every receipt names the same job");
            let stored = env.store.find_job("acct_q", &key).await.unwrap();
            assert_eq!(stored.map(|j| j.id), Some(job), "{key}: its own job");
        }
    }
    assert_eq!(outcomes.get("created"), Some(&200));
    assert_eq!(outcomes.get("duplicate"), Some(&70));
    assert_eq!(outcomes.get("conflict"), Some(&20));
    assert_eq!(outcomes.get("rejected"), Some(&10));
    let (jobs,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, 200);

    // Fewer statements than intents: the counters show the batches.
    let text = onejob::metrics::render();
    let value = |series: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0)
    };
    let (batches, delivered) = (
        value("onejob_intake_batch_size_count"),
        value("onejob_intake_batch_size_sum"),
    );
    assert!(delivered >= 300.0, "{text}");
    assert!(
        batches <= 150.0,
        "{batches} batches for {delivered} deliveries"
    );
    println!("intake: {delivered} deliveries in {batches} batches");

    std::sync::Arc::try_unwrap(producer).unwrap().close().await;
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// Publishes a `summarize` intent to a queue declared with a delivery limit of
/// one (as the test's configuration declares it).
async fn publish_with_limit_one(env: &TestEnv, owner: &str, key: &str) {
    let producer = Producer::connect_with(
        &env.amqp_url,
        onejob_producer::ProducerOptions {
            delivery_limit: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    producer
        .publish_only(&intent(owner, key, "text"))
        .await
        .unwrap();
    producer.close().await;
}

/// Takes the next intent as a worker would, and dies holding it.
async fn dying(amqp: &lapin::Connection) -> lapin::message::Delivery {
    let ch = amqp.create_channel().await.unwrap();
    let got = wait_for("the intent to be delivered", SETTLE, || async {
        ch.basic_get(
            broker::INTENTS_QUEUE.into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
    })
    .await;
    ch.close(200, "worker died".into()).await.unwrap();
    got.delivery
}

/// RabbitMQ counts a delivery held by a worker that died as one that came
/// back: with a delivery limit of 1, two deaths would dead-letter a valid
/// intent. An intent at its limit is handed on as a fresh copy before any work
/// on it, so one more death returns the copy to the queue instead, and
/// nothing valid reaches the dead-letter queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_valid_intent_at_its_delivery_limit_is_handed_on_not_dead_lettered() {
    let text = config_text("http://127.0.0.1:9/v1", None, "")
        .replace("[worker]\n", "[worker]\ndelivery_limit = 1\n");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    publish_with_limit_one(&env, "acct_limit", "k-limit").await;
    let amqp = env.amqp().await;
    let dlq = format!("{}.dlq", broker::INTENTS_QUEUE);

    // A worker takes it and dies: the broker counts it.
    dying(&amqp).await;
    // Redelivered at its limit, to intake: handed on, not worked on.
    let ch = amqp.create_channel().await.unwrap();
    let at_limit = wait_for("the redelivery", SETTLE, || async {
        ch.basic_get(
            broker::INTENTS_QUEUE.into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
    })
    .await;
    assert!(
        onejob::intake::hand_on_if_at_limit(
            &ctx,
            &onejob::shutdown::Shutdown::new(),
            &at_limit.delivery
        )
        .await
    );
    // The copy's worker dies too: it comes back, it is not dead-lettered.
    let copy = dying(&amqp).await;
    assert_eq!(copy.data, at_limit.delivery.data, "the same intent");
    let ch = amqp.create_channel().await.unwrap();
    common::wait_for_depth(
        "the copy back in its queue",
        SETTLE,
        &ch,
        broker::INTENTS_QUEUE,
        1,
    )
    .await;
    assert_eq!(
        common::depth(&ch, &dlq).await,
        0,
        "nothing valid dead-lettered"
    );

    // Worked on by intake, the copy becomes the job.
    drop(ch);
    let fleet = env.fleet(config.clone(), vec![Role::Intake]).await;
    wait_for("the handed-on intent's job", SETTLE, || async {
        env.store.find_job("acct_limit", "k-limit").await.unwrap()
    })
    .await;
    fleet.stop().await;
}

/// Should a valid intent be dead-lettered by the broker all the same (its
/// workers died holding it more often than the limit allows), the reconciler
/// admits it from the dead-letter queue: it ends as a job. The letter stays
/// for an operator, as every dead letter does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_valid_intent_the_broker_dead_lettered_still_ends_as_a_job() {
    let text = config_text("http://127.0.0.1:9/v1", None, "").replace(
        "[worker]\n",
        "[worker]\ndelivery_limit = 1\ndead_letter_scan = \"200ms\"\n",
    );
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    drop(ctx);
    publish_with_limit_one(&env, "acct_dead", "k-dead").await;
    // Two workers die holding it: the broker dead-letters it.
    let amqp = env.amqp().await;
    dying(&amqp).await;
    dying(&amqp).await;
    let ch = amqp.create_channel().await.unwrap();
    let dlq = format!("{}.dlq", broker::INTENTS_QUEUE);
    common::wait_for_depth("the intent dead-lettered", SETTLE, &ch, &dlq, 1).await;

    let fleet = env.fleet(config.clone(), vec![Role::Reconciler]).await;
    let job = wait_for("the dead-lettered intent's job", SETTLE, || async {
        env.store.find_job("acct_dead", "k-dead").await.unwrap()
    })
    .await;
    assert_eq!(job.attempts.len(), 1);
    // Its first attempt was published, and the letter is still there.
    common::wait_for_depth(
        "its first attempt's message",
        SETTLE,
        &ch,
        &broker::attempts_queue("primary"),
        1,
    )
    .await;
    assert_eq!(
        common::depth(&ch, &dlq).await,
        1,
        "the letter stays for an operator"
    );
    fleet.stop().await;
}

/// Receipts go only to direct reply-to or a queue `worker.reply_queues` names:
/// a publisher naming another queue (onejob's own attempts queue, another
/// service's) would otherwise have the worker publish a message of its choice
/// there with the worker's own permissions. Such an intent is dead-lettered
/// with the reason and gets no receipt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn receipts_go_only_to_direct_reply_to_or_an_allowed_queue() {
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
    for (key, reply_to) in [
        ("k-forged", attempts.as_str()),
        ("k-allowed", "svc.replies"),
    ] {
        let body = serde_json::to_vec(&intent("acct_reply", key, "text")).unwrap();
        ch.basic_publish(
            broker::EXCHANGE.into(),
            broker::INTENTS_KEY.into(),
            BasicPublishOptions::default(),
            &body,
            broker::json_properties()
                .with_reply_to(reply_to.into())
                .with_correlation_id(key.into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let dlq = format!("{}.dlq", broker::INTENTS_QUEUE);
    let letter = wait_for_messages(&env, &ch, &dlq).await.remove(0);
    let headers = letter.properties.headers().clone().unwrap_or_default();
    let error = header_str(&headers, broker::ERROR_HEADER).unwrap_or_default();
    assert!(error.starts_with("reply_to_refused"), "{error}");
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
    assert!(
        env.store
            .find_job("acct_reply", "k-forged")
            .await
            .unwrap()
            .is_none()
    );
    fleet.stop().await;
}
