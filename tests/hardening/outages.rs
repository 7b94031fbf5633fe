//! Postgres outages (through a TCP path the test cuts) and stopping workers:
//! a delivery whose work did not commit is held or handed back, never acked,
//! and a stopping worker starts nothing new.

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use crate::common::{
    self, P, TestEnv, config, config_for, config_text, mock, submit, wait_for, wait_for_status,
};

/// A worker context whose Postgres connections go through a TCP path the test
/// can cut and restore.
pub(super) async fn behind_a_cuttable_postgres(
    env: &TestEnv,
    config: &std::sync::Arc<onejob::settings::config::Config>,
) -> (common::Cuttable, onejob::shared::runtime::Context) {
    let path = common::Cuttable::to("127.0.0.1:5432").await;
    let proxied = env
        .database_url
        .replace("127.0.0.1:5432", &path.addr.to_string());
    let ctx = onejob::shared::runtime::Context::connect(config.clone(), &proxied, &env.amqp_url)
        .await
        .unwrap();
    (path, ctx)
}

/// Item 4: a Postgres outage longer than the delivery limit would allow if
/// deliveries were handed back. With a delivery limit of 1, intents published
/// during the outage are held, unacked, while the worker reports itself unready;
/// once Postgres is back every one becomes a job and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_outage_costs_no_delivery_and_loses_nothing() {
    let primary = mock(MockOptions::default()).await;
    let text = config_for(&[P("primary", &primary.base_url(), "")], "")
        .replace("[worker]\n", "[worker]\ndelivery_limit = 1\n");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let (path, ctx) = behind_a_cuttable_postgres(&env, &config).await;
    let shutdown = onejob::edges::shutdown::Shutdown::new();
    let run = tokio::spawn(onejob::fleet::run(ctx.clone(), vec![], shutdown.clone()));
    let producer = Producer::connect_with(
        &env.amqp_url,
        onejob_producer::ProducerOptions {
            delivery_limit: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let warm = submit(&producer, "acct_o", "warm", "before").await;
    wait_for_status(&env, warm, JobStatus::Succeeded).await;

    path.cut();
    let keys: Vec<String> = (0..20).map(|i| format!("during-{i}")).collect();
    for key in &keys {
        producer
            .publish_only(&common::intent("acct_o", key, "during the outage"))
            .await
            .unwrap();
    }
    assert!(
        !ctx.store.ping().await,
        "the worker sees the outage (/readyz: postgres down)"
    );
    let ch = env.amqp().await.create_channel().await.unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    held_through_the_outage(&env, &path, &ch, &dlq).await;
    path.restore();

    for key in &keys {
        let job = wait_for(
            &format!("a job for {key}"),
            Duration::from_secs(60),
            || async { env.store.jobs().find("acct_o", key).await.unwrap() },
        )
        .await;
        wait_for_status(&env, job.id, JobStatus::Succeeded).await;
    }
    assert_eq!(common::depth(&ch, &dlq).await, 0, "nothing dead-lettered");
    producer.close().await;
    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Every intent of the outage (20) is delivered to the worker, which holds
/// it unacked: for at least 8 s, and until the worker has tried Postgres
/// again and again, nothing is handed back or dead-lettered.
async fn held_through_the_outage(
    env: &TestEnv,
    path: &common::Cuttable,
    ch: &lapin::Channel,
    dlq: &str,
) {
    let intents = onejob::broker::INTENTS_QUEUE;
    // Every intent was delivered to the worker, which holds it unacked.
    wait_for(
        "the worker to hold every intent of the outage",
        Duration::from_secs(20),
        || async { (common::queue_counts(&env.name, intents) == Some((0, 20))).then_some(()) },
    )
    .await;
    // Held through the outage: for at least 8 s, and until the worker has tried
    // Postgres again and again (each try a chance to give up and hand the
    // deliveries back, which with a delivery limit of 1 dead-letters them on
    // the second return), the deliveries stay with it and nothing is
    // dead-lettered.
    let tries_before = path.refused();
    let held_since = std::time::Instant::now();
    wait_for(
        "the worker to keep trying Postgres through the outage",
        Duration::from_secs(60),
        || async {
            assert_eq!(
                common::queue_counts(&env.name, intents),
                Some((0, 20)),
                "every intent stays delivered and unacked"
            );
            assert_eq!(
                common::depth(ch, dlq).await,
                0,
                "nothing dead-lettered during the outage"
            );
            (held_since.elapsed() >= Duration::from_secs(8) && path.refused() >= tries_before + 10)
                .then_some(())
        },
    )
    .await;
}

/// Issue 11 review: a delivery whose work did not commit goes back to its
/// queue, never acked. Here the claim cannot commit (Postgres unreachable) when
/// the worker stops: the attempt message must be in its queue again, ready for
/// the next worker, and the attempt still `queued`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_not_claimed_when_the_worker_stops_goes_back_to_its_queue() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let (path, ctx) = behind_a_cuttable_postgres(&env, &config).await;
    let shutdown = onejob::edges::shutdown::Shutdown::new();
    let run = tokio::spawn(onejob::fleet::run(
        ctx.clone(),
        vec![onejob::fleet::Role::Attempts("primary".into())],
        shutdown.clone(),
    ));
    let (job_id, message) = env.admit(&ctx, "acct_r", "requeue", "x").await;

    path.cut();
    onejob::shared::runtime::publish_outbox(&ctx.publisher, &env.store, &[message])
        .await
        .unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    let ch = env.amqp().await.create_channel().await.unwrap();
    // Taken by the worker, which cannot claim it while Postgres is away.
    common::wait_for_depth(
        "the worker to take the message",
        Duration::from_secs(10),
        &ch,
        &queue,
        0,
    )
    .await;
    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // The broker takes the returned message back on its own time.
    common::wait_for_depth(
        "the unclaimed attempt's message to be back in its queue",
        Duration::from_secs(15),
        &ch,
        &queue,
        1,
    )
    .await;
    path.restore();
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Queued);
}

/// Issue 11 review: a stopping worker starts nothing new. With one call slot,
/// a slow call in flight and a second attempt waiting for the slot, shutdown
/// lets the call finish and settle, and hands the waiting one back to its queue
/// unstarted, without calling the provider for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_worker_starts_nothing_new() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(1500),
        ..MockOptions::default()
    })
    .await;
    let text = config_for(
        &[P("primary", &primary.base_url(), "timeout = \"10s\"")],
        "",
    )
    .replace("concurrency = 8", "concurrency = 1");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(
            config.clone(),
            vec![onejob::fleet::Role::Attempts("primary".into())],
        )
        .await;
    // Two owners: with one call slot an owner's share of the queue is one,
    // and both messages must be in it.
    let (first, m1) = env.admit(&fleet.ctx, "acct_s", "first", "x").await;
    let (second, m2) = env.admit(&fleet.ctx, "acct_t", "second", "x").await;
    fleet.ctx.publish_outbox(&[m1, m2]).await.unwrap();
    wait_for("one call in flight", Duration::from_secs(10), || async {
        (primary.stats.requests() == 1).then_some(())
    })
    .await;
    fleet.stop().await;

    assert_eq!(primary.stats.requests(), 1, "nothing called after shutdown");
    let done = env.store.jobs().job(first).await.unwrap().unwrap();
    let waiting = env.store.jobs().job(second).await.unwrap().unwrap();
    // Which of the two got the slot first is the broker's order.
    let (done, waiting) = if done.status == JobStatus::Succeeded {
        (done, waiting)
    } else {
        (waiting, done)
    };
    assert_eq!(
        done.status,
        JobStatus::Succeeded,
        "the call in flight settled"
    );
    assert_eq!(waiting.attempts[0].status, AttemptStatus::Queued);
    let ch = env.amqp().await.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    common::wait_for_depth(
        "the waiting attempt's message to be back in its queue",
        Duration::from_secs(15),
        &ch,
        &queue,
        1,
    )
    .await;
}
