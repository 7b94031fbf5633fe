//! onejob's own dead letters: what a copy keeps, and `dlq replay --all`.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use onejob::mock::MockOptions;

use crate::common::{self, P, TestEnv, config, config_for, mock, wait_for, wait_for_messages};

/// Item 3: onejob's own dead letters keep what the contract lists and drop what
/// would make the broker refuse (`user_id`) or expire (`expiration`) the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_copy_keeps_the_listed_properties_only() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_for(&[P("primary", &primary.base_url(), "")], ""));
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        "x-trace".into(),
        AMQPValue::LongString(LongString::from("t-1")),
    );
    let props = onejob::broker::json_properties()
        .with_message_id("m-1".into())
        .with_correlation_id("c-1".into())
        .with_reply_to("nowhere".into())
        .with_timestamp(1_700_000_000)
        .with_expiration("600000".into())
        .with_user_id("guest".into())
        .with_headers(headers);
    ch.basic_publish(
        onejob::broker::EXCHANGE.into(),
        onejob::broker::INTENTS_KEY.into(),
        BasicPublishOptions::default(),
        b"not json",
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    let copy = wait_for_messages(&env, &ch, &dlq).await.remove(0);
    let p = &copy.properties;
    assert_eq!(copy.data, b"not json");
    assert_eq!(p.expiration(), &None, "a copy must not expire");
    assert_eq!(
        p.user_id(),
        &None,
        "a copy must not claim the publisher's user"
    );
    assert_eq!(p.message_id().as_ref().map(|m| m.as_str()), Some("m-1"));
    assert_eq!(p.correlation_id().as_ref().map(|m| m.as_str()), Some("c-1"));
    assert_eq!(p.reply_to().as_ref().map(|m| m.as_str()), Some("nowhere"));
    assert_eq!(p.timestamp(), &Some(1_700_000_000));
    assert_eq!(p.delivery_mode(), &Some(2));
    let h = p.headers().clone().unwrap_or_default();
    assert_eq!(
        onejob::broker::header_str(&h, "x-trace").as_deref(),
        Some("t-1")
    );
    assert!(onejob::broker::header_str(&h, onejob::broker::ERROR_HEADER).is_some());
    let _ = conn.close(200, "done".into()).await;
    fleet.stop().await;
}

/// Runs the operator CLI against `env`, killed if it runs past a minute (a
/// replay that never ends must fail the test, not hang it).
fn cli_bounded(
    env: &TestEnv,
    config_path: &std::path::Path,
    args: &[&str],
) -> std::process::Output {
    std::process::Command::new("timeout")
        .arg("60")
        .arg(env!("CARGO_BIN_EXE_onejob"))
        .args(args)
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", config_path)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the onejob CLI")
}

/// Item 11: `dlq replay --all` looks only at the letters present when it starts
/// (a letter that dies again is not replayed again and again), reports each one,
/// and skips a letter it cannot replay instead of stopping there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dlq_replay_all_is_bounded_and_reports_each_letter() {
    let primary = mock(MockOptions::default()).await;
    let (config, file) = config(&config_for(&[P("primary", &primary.base_url(), "")], ""));
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    plant_three_letters(&ch, &dlq).await;
    assert_eq!(common::depth(&ch, &dlq).await, 3);

    let out = cli_bounded(
        &env,
        &file.path,
        &["dlq", "replay", &dlq, "--all", "--json"],
    );
    reports_each_letter(&out);

    // The good intent became a job; the bad one died once more, and it and the
    // orphan are what the queue holds.
    let job = wait_for(
        "the replayed intent's job",
        Duration::from_secs(20),
        || async { env.store.jobs().find("acct_r", "good").await.unwrap() },
    )
    .await;
    assert_eq!(job.idempotency_key, "good");
    common::wait_for_depth(
        "the bad intent to die again",
        Duration::from_secs(20),
        &ch,
        &dlq,
        2,
    )
    .await;
    let _ = conn.close(200, "done".into()).await;
    fleet.stop().await;
}

/// Publishes `body` as message `id` with `headers` to `exchange` under `key`,
/// and waits for the broker's confirm.
async fn publish(
    ch: &lapin::Channel,
    exchange: &str,
    key: &str,
    id: &str,
    body: &[u8],
    headers: FieldTable,
) {
    ch.basic_publish(
        exchange.into(),
        key.into(),
        BasicPublishOptions::default(),
        body,
        onejob::broker::json_properties()
            .with_message_id(id.into())
            .with_headers(headers),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// The headers that name a letter's origin: `exchange` and `routing_key`.
fn origin(exchange: &str, routing_key: &str) -> FieldTable {
    let mut headers = FieldTable::default();
    for (k, v) in [
        ("x-onejob-original-exchange", exchange),
        ("x-onejob-original-routing-key", routing_key),
    ] {
        headers.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
    }
    headers
}

/// Three letters on `dlq`: a bad intent, a good one with its origin, and one
/// whose headers name somewhere else than its own work queue.
async fn plant_three_letters(ch: &lapin::Channel, dlq: &str) {
    // A bad intent, dead-lettered by intake: replaying it makes it die again.
    publish(
        ch,
        onejob::broker::EXCHANGE,
        onejob::broker::INTENTS_KEY,
        "bad-1",
        b"not json",
        FieldTable::default(),
    )
    .await;
    common::wait_for_depth(
        "the bad intent's dead letter",
        Duration::from_secs(20),
        ch,
        dlq,
        1,
    )
    .await;
    // A good intent with its origin.
    let good = serde_json::to_vec(&common::intent("acct_r", "good", "replayed")).unwrap();
    publish(
        ch,
        onejob::broker::DLX,
        onejob::broker::INTENTS_QUEUE,
        "good-1",
        &good,
        origin(onejob::broker::EXCHANGE, onejob::broker::INTENTS_KEY),
    )
    .await;
    // A letter whose headers name somewhere else than its own work queue: a
    // replay never goes there (it goes only home), so it is skipped.
    publish(
        ch,
        onejob::broker::DLX,
        onejob::broker::INTENTS_QUEUE,
        "orphan-1",
        b"{}",
        origin(onejob::broker::EVENTS, "job.succeeded"),
    )
    .await;
}

/// `dlq replay --all --json` ended, replayed two letters and skipped the
/// orphan, saying why, and reported each letter without its body.
fn reports_each_letter(out: &std::process::Output) {
    assert_ne!(out.status.code(), Some(124), "replay did not end");
    assert_eq!(
        out.status.code(),
        Some(1),
        "a skipped letter is reported: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(report["replayed"], 2, "{report}");
    assert_eq!(report["skipped"], 1, "{report}");
    let letters = report["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 3);
    let orphan = letters
        .iter()
        .find(|l| l["message_id"] == "orphan-1")
        .unwrap();
    assert_eq!(orphan["outcome"], "skipped");
    assert!(
        orphan["reason"]
            .as_str()
            .unwrap()
            .contains("a replay goes only to the work queue its dead-letter queue belongs to"),
        "{orphan}"
    );
    assert!(letters.iter().all(|l| l.get("body").is_none()));
}
