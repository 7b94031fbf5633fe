//! Crashes and redeliveries: a crash between commit and ack is a duplicate of
//! the same job, and a valid intent whose workers died holding it still ends
//! as a job, never dead-lettered for good.

use lapin::options::{BasicGetOptions, BasicPublishOptions};
use onejob::broker;
use onejob::broker::header_str;
use onejob::domain::JobStatus;
use onejob::edges::store::Admission;
use onejob::fleet::Role;
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use super::SETTLE;
use crate::common::{
    self, TestEnv, config, config_text, intent, mock, wait_for, wait_for_messages, wait_for_status,
};

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
    let got = taken(&ch, "the intent to arrive").await;
    assert!(!got.delivery.redelivered);
    let new_job = onejob::roles::intake::validate(&ctx, &got.delivery.data).expect("valid intent");
    let created = match ctx
        .store
        .admission()
        .admit(&[new_job])
        .await
        .unwrap()
        .remove(0)
    {
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

    a_malformed_attempt_message_is_dead_lettered(&env, &ctx).await;

    std::sync::Arc::try_unwrap(pending.1).unwrap().close().await;
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// A malformed attempt message is dead-lettered with its reason, not looped.
async fn a_malformed_attempt_message_is_dead_lettered(
    env: &TestEnv,
    ctx: &onejob::shared::runtime::Context,
) {
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
    let dead = wait_for_messages(env, &ch, &dlq).await;
    let headers = dead[0].properties.headers().clone().unwrap_or_default();
    assert!(
        header_str(&headers, broker::ERROR_HEADER)
            .unwrap_or_default()
            .starts_with("malformed_attempt_message")
    );
}

/// The next intent on `ch`, taken unacked as a worker takes it, once it is
/// there (`what` names it, should it never come).
async fn taken(ch: &lapin::Channel, what: &str) -> lapin::message::BasicGetMessage {
    wait_for(what, SETTLE, || async {
        ch.basic_get(
            broker::INTENTS_QUEUE.into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
    })
    .await
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
        .publish_only_in_trace(&intent(owner, key, "text"), &publishers_trace())
        .await
        .unwrap();
    producer.close().await;
}

/// The trace the intents of these tests are published in.
fn publishers_trace() -> onejob::trace::TraceContext {
    onejob::trace::TraceContext::parse(
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        None,
    )
    .unwrap()
}

/// Takes the next intent as a worker would, and dies holding it.
async fn dying(amqp: &lapin::Connection) -> lapin::message::Delivery {
    let ch = amqp.create_channel().await.unwrap();
    let got = taken(&ch, "the intent to be delivered").await;
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
    let at_limit = taken(&ch, "the redelivery").await;
    assert!(
        onejob::roles::intake::hand_on_if_at_limit(
            &ctx,
            &onejob::edges::shutdown::Shutdown::new(),
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
        env.store
            .jobs()
            .find("acct_limit", "k-limit")
            .await
            .unwrap()
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
        env.store.jobs().find("acct_dead", "k-dead").await.unwrap()
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
    // The reconciler's scans look at the letter every 200 ms without taking
    // it: while one holds it unacked the queue's depth reads 0 for a moment.
    common::wait_for_depth(
        "the letter, still there for an operator",
        SETTLE,
        &ch,
        &dlq,
        1,
    )
    .await;
    // The publisher's trace continues through the dead-letter queue.
    let stored: Option<String> = sqlx::query_scalar("SELECT traceparent FROM jobs WHERE id = $1")
        .bind(job.id.0)
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    let stored = onejob::trace::TraceContext::parse(&stored.expect("a trace"), None).unwrap();
    assert_eq!(stored.trace_id, publishers_trace().trace_id);
    fleet.stop().await;
}
