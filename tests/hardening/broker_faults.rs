//! The broker's faults: queues declared the old way, a publishing channel the
//! broker closes, a connection gone for good, a confirm that never comes, a
//! channel that never opens.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use onejob::domain::JobStatus;

use super::Running;
use crate::common::{self, TestEnv, config, config_text, submit, wait_for, wait_for_status};

/// Item 5: work queues are declared for at-least-once dead-lettering. A fleet
/// that meets a queue declared the old way says so in one line naming the queue
/// and the way out; `onejob queues upgrade` redeclares it only once it is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn old_queues_are_named_and_upgraded_only_when_empty() {
    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    // onejob.intents as the previous version declared it, with a message in it.
    declare_the_old_way(&ch, "onejob.intents").await;
    ch.basic_publish(
        "".into(),
        "onejob.intents".into(),
        BasicPublishOptions::default(),
        b"{}",
        onejob::broker::json_properties(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    // onejob.attempts.primary declared the old way too, but empty.
    declare_the_old_way(&ch, "onejob.attempts.primary").await;

    a_fleet_is_refused_naming_the_queue(&env, &config).await;

    let out = env.cli(&file.path, &["queues", "upgrade", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["queues"]["onejob.intents"]["outcome"], "refused",
        "{report}"
    );
    assert_eq!(report["queues"]["onejob.intents"]["messages"], 1);
    assert_eq!(
        common::depth(&ch, "onejob.intents").await,
        1,
        "never deleted with a message in it"
    );
    // The empty one was redeclared, and bound again although the other was refused.
    assert_eq!(
        report["queues"]["onejob.attempts.primary"]["outcome"], "redeclared",
        "{report}"
    );
    let publisher = onejob::broker::Publisher::open(&conn).await.unwrap();
    publisher
        .publish(
            onejob::broker::EXCHANGE,
            &onejob::broker::attempts_routing_key("primary"),
            b"{}",
            onejob::broker::json_properties(),
            true,
        )
        .await
        .expect("routable again at once");
    assert_eq!(env.drain(&ch, "onejob.attempts.primary").await.len(), 1);

    // Drained, it is redeclared, and the fleet starts.
    assert_eq!(env.drain(&ch, "onejob.intents").await.len(), 1);
    let out = env.cli_ok(&file.path, &["queues", "upgrade", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["queues"]["onejob.intents"]["outcome"], "redeclared",
        "{report}"
    );
    assert_eq!(
        report["queues"]["onejob.attempts.primary"]["outcome"], "current",
        "{report}"
    );
    work_queues_are_current(&env.name);
    let ctx = env.context(config.clone()).await;
    let _ = ctx.connection.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
}

/// A fleet does not start on `env` while `onejob.intents` is outdated, and
/// says so in one line naming the queue and the way out.
async fn a_fleet_is_refused_naming_the_queue(
    env: &TestEnv,
    config: &std::sync::Arc<onejob::settings::config::Config>,
) {
    let refused =
        onejob::shared::runtime::Context::connect(config.clone(), &env.database_url, &env.amqp_url)
            .await
            .expect_err("a fleet must not start on an outdated queue")
            .to_string();
    assert!(
        refused.contains("\"onejob.intents\"") && refused.contains("onejob queues upgrade"),
        "{refused}"
    );
    assert_eq!(refused.lines().count(), 1, "{refused}");
}

/// Declares `queue` as the previous version did: quorum, dead-lettered to
/// `onejob.dlx` at most once.
async fn declare_the_old_way(ch: &lapin::Channel, queue: &str) {
    let mut args = FieldTable::default();
    let text = |v: &str| AMQPValue::LongString(LongString::from(v));
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert("x-dead-letter-exchange".into(), text("onejob.dlx"));
    args.insert("x-dead-letter-routing-key".into(), text(queue));
    args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(5));
    ch.queue_declare(
        queue.into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
}

/// The three work queues of `vhost` (intents, settlements and the
/// primary's attempts; `rabbitmqctl` lists their arguments) are declared for
/// at-least-once dead-lettering.
fn work_queues_are_current(vhost: &str) {
    let listed = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "-p", vhost, "name", "arguments"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    let work: Vec<&str> = listed
        .lines()
        .filter(|l| l.starts_with("onejob.") && !l.contains(".dlq"))
        .collect();
    assert_eq!(work.len(), 3, "{listed}");
    for line in work {
        assert!(
            line.contains("at-least-once") && line.contains("reject-publish"),
            "{line}"
        );
    }
}

/// Item 2: when the broker closes the publishing channel (here: a publish to an
/// exchange that does not exist), a new one is opened, readiness says so while it
/// is down, and receipts and attempts flow again. Before, every later publish
/// failed while `/readyz` said ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_closed_publishing_channel_is_reopened() {
    let Running {
        primary: _primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("", 3).await;
    let ctx = fleet.ctx.clone();
    for round in 0..3 {
        let before = ctx.publisher.channel();
        let refused = ctx
            .publisher
            .publish(
                "no-such-exchange",
                "k",
                b"{}",
                onejob::broker::json_properties(),
                false,
            )
            .await;
        assert!(refused.is_err(), "the broker refuses an unknown exchange");
        wait_for(
            "the channel to be replaced",
            Duration::from_secs(10),
            || async {
                (ctx.publisher.is_open() && ctx.publisher.channel().id() != before.id())
                    .then_some(())
            },
        )
        .await;
        let job_id = submit(
            &producer,
            "acct_ch",
            &format!("k{round}"),
            "after a closed channel",
        )
        .await;
        wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    }
    producer.close().await;
    fleet.stop().await;
}

/// Item 2: when the AMQP connection is gone for good, every role stops (the
/// reconciler too, whether its passes or its consumer of handed-on
/// settlements notices first) and the worker reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_the_broker_for_good_stops_every_role() {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let shutdown = onejob::edges::shutdown::Shutdown::new();
    let run = tokio::spawn(onejob::fleet::run(
        ctx.clone(),
        vec![onejob::fleet::Role::Reconciler],
        shutdown.clone(),
    ));
    ctx.connection
        .close(320, "gone for good".into())
        .await
        .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the worker stops by itself")
        .unwrap();
    let error = result.expect_err("and says why").to_string();
    assert!(error.contains("RabbitMQ connection lost"), "{error}");
}

/// Item 15: a confirm that never comes (a hung broker: the connection stays
/// open, nothing moves) is reported as what it is, not as a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_confirm_is_a_timeout_not_a_nack() {
    let (_env, path, conn) = through_a_path().await;
    let publisher = onejob::broker::Publisher::open(&conn)
        .await
        .unwrap()
        .with_confirm_timeout(Duration::from_millis(500));
    path.stall();
    let error = publisher
        .publish(
            "",
            "nowhere",
            b"{}",
            onejob::broker::json_properties(),
            false,
        )
        .await
        .expect_err("no confirm can come")
        .to_string();
    assert!(
        error.starts_with("no publisher confirm") && !error.contains("nacked"),
        "{error}"
    );
    path.restore();
}

/// A channel whose opening the broker never answers (a hung path: the
/// connection stays open, nothing moves) is a timeout counted as the broker
/// being unavailable, not a wait for good; once the path moves again, channels
/// open on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_channel_that_never_opens_is_a_timeout() {
    let (_env, path, conn) = through_a_path().await;
    path.stall();
    let error = onejob::broker::open_channel_within(&conn, Duration::from_millis(500))
        .await
        .expect_err("no channel can open through a stalled path");
    assert_eq!(
        error.to_string(),
        "RabbitMQ did not open a channel within 500ms"
    );
    assert!(onejob::shared::runtime::WorkerError::from(error).is_unavailable());
    path.restore();
    wait_for(
        "a channel to open once the path moves again",
        Duration::from_secs(20),
        || async {
            onejob::broker::open_channel_within(&conn, Duration::from_secs(2))
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
    let _ = conn.close(200, "done".into()).await;
}

/// A vhost of the test's own, a TCP path to the local broker that the test
/// can stall and cut, and a connection to the vhost through it that does not
/// recover.
async fn through_a_path() -> (TestEnv, common::Cuttable, lapin::Connection) {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let (path, url) = broker_path(&env).await;
    let conn = onejob::broker::connect(&url, onejob::broker::Recovery::None)
        .await
        .unwrap();
    (env, path, conn)
}

/// A TCP path to the local broker that a test can stall and cut, and the
/// AMQP URL of `env`'s vhost through it.
pub(super) async fn broker_path(env: &TestEnv) -> (common::Cuttable, String) {
    let path = common::Cuttable::to("127.0.0.1:5672").await;
    let url = env
        .amqp_url
        .replace("127.0.0.1:5672", &path.addr.to_string());
    (path, url)
}
