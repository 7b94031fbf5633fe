//! Dead letters on the real broker: poison messages end in the DLQ with a reason,
//! `onejob dlq list` browses without consuming, `replay` republishes (confirmed)
//! before it removes, `purge` needs --yes.

use onejob_test_support as common;

use std::path::Path;

use common::{TestEnv, config, config_text, depth, mock, wait_for, wait_for_status};
use lapin::options::{BasicGetOptions, BasicNackOptions, BasicPublishOptions};
use onejob::broker;
use onejob::domain::JobStatus;
use onejob::fleet::Role;
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json output")
}

/// Takes the message off `queue` and returns it, again and again, as a worker that
/// crashes on it would, until the delivery limit dead-letters it; then waits until
/// it is in the dead-letter queue. Returns how often it was delivered.
async fn poison(ch: &lapin::Channel, queue: &str) -> usize {
    let mut deliveries = 0;
    while let Some(got) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
    {
        deliveries += 1;
        got.delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await
            .unwrap();
        assert!(deliveries < 50, "the delivery limit never dead-lettered it");
    }
    // Quorum queues dead-letter asynchronously.
    let dlq = broker::dead_letter_queue(queue);
    wait_for(
        "the dead letter",
        std::time::Duration::from_secs(20),
        || async { (depth(ch, &dlq).await == 1).then_some(()) },
    )
    .await;
    deliveries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dlq_list_browses_without_consuming_and_purge_needs_yes() {
    let primary = mock(MockOptions::default()).await;
    let (config, file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![Role::Intake]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    for body in [
        &b"not json"[..],
        br#"{"owner_id":"a","idempotency_key":"k","operation":"nope","input":{}}"#,
    ] {
        assert_eq!(
            producer.submit_raw(body).await.unwrap().outcome,
            Outcome::Rejected
        );
    }
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    let dlq = broker::dead_letter_queue(broker::INTENTS_QUEUE);
    assert_eq!(depth(&ch, &dlq).await, 2);

    let first = json(&env.cli(&file.path, &["dlq", "list", "--json"]));
    let second = json(&env.cli(&file.path, &["dlq", "list", "onejob.intents.dlq", "--json"]));
    let strip_age = |v: &serde_json::Value| {
        let mut v = v.clone();
        for d in v.as_array_mut().unwrap() {
            d.as_object_mut().unwrap().remove("age_seconds");
        }
        v
    };
    assert_eq!(
        strip_age(&first),
        strip_age(&second),
        "browsing twice gives the same listing"
    );
    assert_eq!(depth(&ch, &dlq).await, 2, "browsing consumed nothing");
    each_letter_says_what_it_was(first.as_array().unwrap());
    let human = env.cli(&file.path, &["dlq", "list"]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains("onejob.intents.dlq: 2 dead letter(s)") && text.contains("invalid_json"),
        "{text}"
    );

    refused_commands_do_nothing(&env, &file.path, &ch, &dlq).await;
    let purged = json(&env.cli(
        &file.path,
        &[
            "dlq",
            "purge",
            "onejob.intents.dlq",
            "--yes",
            "--json",
            "--reason",
            "junk from a test",
        ],
    ));
    assert_eq!(purged["purged"]["onejob.intents.dlq"], 2);
    assert_eq!(depth(&ch, &dlq).await, 0);
    // Audited: who, why, and what came of it.
    let audit = env.store.audit().recent(10).await.unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].action, "dlq.purge");
    assert!(audit[0].actor.starts_with("cli:"), "{:?}", audit[0]);
    assert_eq!(audit[0].reason, "junk from a test");
    assert_eq!(audit[0].target.as_deref(), Some("onejob.intents.dlq"));
    assert_eq!(audit[0].detail["outcome"], "done");
    assert_eq!(audit[0].detail["purged"]["onejob.intents.dlq"], 2);

    producer.close().await;
    fleet.stop().await;
}

/// Both letters, the invalid JSON first: each with its reason, its message id
/// and age, where it was going, and the start of its body.
fn each_letter_says_what_it_was(letters: &[serde_json::Value]) {
    assert_eq!(letters.len(), 2);
    assert!(
        letters[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("invalid_json")
    );
    assert!(
        letters[1]["reason"]
            .as_str()
            .unwrap()
            .starts_with("unknown_operation")
    );
    for letter in letters {
        // The producer names each intent, and intake stamps when it gave up on it.
        assert!(
            letter["message_id"]
                .as_str()
                .is_some_and(|id| !id.is_empty()),
            "{letter}"
        );
        assert!(
            letter["age_seconds"]
                .as_i64()
                .is_some_and(|a| (0..60).contains(&a)),
            "{letter}"
        );
    }
    assert_eq!(letters[0]["original_exchange"], "onejob");
    assert_eq!(letters[0]["original_routing_key"], "intents");
    assert_eq!(letters[0]["body_preview"], "not json");
}

/// `purge` without --yes, `list` of a queue that is not there and `replay`
/// without --id or --all are refused, and do and record nothing.
async fn refused_commands_do_nothing(env: &TestEnv, config: &Path, ch: &lapin::Channel, dlq: &str) {
    let refused = env.cli(config, &["dlq", "purge", "onejob.intents.dlq"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--yes"));
    assert_eq!(depth(ch, dlq).await, 2);
    assert_eq!(
        env.cli(config, &["dlq", "list", "no.such.queue"])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        env.cli(config, &["dlq", "replay", "onejob.intents.dlq"])
            .status
            .code(),
        Some(2),
        "--id or --all"
    );
    assert!(
        env.store.audit().recent(10).await.unwrap().is_empty(),
        "refused commands record nothing"
    );
}

/// An attempt message that keeps failing (a worker crashing on it) is
/// dead-lettered by the delivery limit, with the broker's reason; once the cause is
/// gone, `dlq replay --id` republishes it and the job completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_attempt_is_dead_lettered_then_replayed() {
    let primary = mock(MockOptions::default()).await;
    let (config, file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job_id, publish) = env.admit(&ctx, "acct_p", "k", "poison").await;
    ctx.publish_outbox(std::slice::from_ref(&publish))
        .await
        .unwrap();

    let ch = ctx.connection.create_channel().await.unwrap();
    let queue = broker::attempts_queue("primary");
    let deliveries = poison(&ch, &queue).await;
    assert!(
        deliveries >= 5,
        "delivered {deliveries} times before dead-lettering"
    );
    let dlq = broker::dead_letter_queue(&queue);

    let listed = json(&env.cli(&file.path, &["dlq", "list", &queue, "--json"]));
    let letter = &listed[0];
    assert_eq!(letter["reason"], "delivery_limit", "{letter}");
    assert_eq!(letter["message_id"], publish.message_id);
    assert_eq!(letter["original_exchange"], "onejob");
    assert_eq!(letter["original_routing_key"], "attempts.primary");
    assert_eq!(letter["deaths"][0]["queue"], queue);

    // The cause is gone: replay it, and a worker completes the job.
    let fleet = env
        .fleet(config.clone(), vec![Role::Attempts("primary".into())])
        .await;
    let replayed = json(&env.cli(
        &file.path,
        &["dlq", "replay", &dlq, "--id", &publish.message_id, "--json"],
    ));
    assert_eq!(replayed["replayed"], 1);
    assert_eq!(
        depth(&ch, &dlq).await,
        0,
        "removed after the confirmed republish"
    );
    let audit = env.store.audit().recent(10).await.unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].action, "dlq.replay");
    assert_eq!(audit[0].reason, "", "no --reason given");
    assert_eq!(audit[0].detail["message_id"], publish.message_id.as_str());
    assert_eq!(
        (&audit[0].detail["outcome"], &audit[0].detail["replayed"]),
        (&serde_json::json!("done"), &serde_json::json!(1))
    );
    wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    let missing = env.cli(&file.path, &["dlq", "replay", &dlq, "--id", "nope"]);
    assert_eq!(missing.status.code(), Some(1));

    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// An attempt message naming no attempt is dead-lettered with its reason, not
/// dropped in silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_message_for_no_attempt_is_dead_lettered() {
    let primary = mock(MockOptions::default()).await;
    let (config, file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![Role::Attempts("primary".into())])
        .await;
    let ch = fleet.ctx.connection.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let body =
        serde_json::json!({ "attempt_id": uuid::Uuid::now_v7(), "job_id": uuid::Uuid::now_v7() });
    ch.basic_publish(
        broker::EXCHANGE.into(),
        "attempts.primary".into(),
        BasicPublishOptions::default(),
        body.to_string().as_bytes(),
        broker::json_properties(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let listed = wait_for(
        "the dead letter",
        std::time::Duration::from_secs(20),
        || async {
            let v = json(&env.cli(
                &file.path,
                &["dlq", "list", "onejob.attempts.primary.dlq", "--json"],
            ));
            (!v.as_array().unwrap().is_empty()).then_some(v)
        },
    )
    .await;
    assert!(
        listed[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("unknown_attempt"),
        "{listed}"
    );
    assert_eq!(primary.stats.requests(), 0);
    fleet.stop().await;
}

/// With a reconciler running, an attempt whose message was dead-lettered while it
/// was still queued is marked failed with the dead letter's reason, and the job
/// goes on with its next attempt; the dead letter stays for the operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_lettered_attempt_is_reflected_on_its_row() {
    let primary = mock(MockOptions::default()).await;
    let text = config_text(&primary.base_url(), None, "")
        .replace("[worker]\n", "[worker]\ndead_letter_scan = \"200ms\"\n");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job_id, publish) = env.admit(&ctx, "acct_r", "k", "reflect").await;
    ctx.publish_outbox(std::slice::from_ref(&publish))
        .await
        .unwrap();
    let ch = ctx.connection.create_channel().await.unwrap();
    let queue = broker::attempts_queue("primary");
    poison(&ch, &queue).await;
    let dlq = broker::dead_letter_queue(&queue);

    let fleet = env
        .fleet(
            config.clone(),
            vec![Role::Reconciler, Role::Attempts("primary".into())],
        )
        .await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 2);
    let first = &job.attempts[0];
    assert_eq!(first.status, onejob::domain::AttemptStatus::Failed);
    assert!(
        first
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("dead_lettered: delivery_limit"),
        "{:?}",
        first.error
    );
    // The reconciler's scans look at the letter every 200 ms without taking
    // it: while one holds it unacked the queue's depth reads 0 for a moment.
    common::wait_for_depth(
        "the dead letter, still there for the operator",
        std::time::Duration::from_secs(10),
        &ch,
        &dlq,
        1,
    )
    .await;
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// The chaos tests' invariant checker (`test-support/src/chaos.rs`) on a valid
/// intent dead-lettered by the delivery limit: its key has no job, so it is
/// lost, whatever the dead-letter queue holds; and a dead-lettered re-send of
/// a key that has its job is still counted as a valid intent dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_chaos_checker_counts_dead_lettered_valid_intents() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    env.admit(&ctx, "acct_chaos", "made", "made").await;
    // No intake runs: a worker crashing on each delivery, as `poison` plays it,
    // until the broker dead-letters both.
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    for key in ["dead", "made"] {
        producer
            .publish_only(&common::intent("acct_chaos", key, key))
            .await
            .unwrap();
    }
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    let mut deliveries = 0;
    while let Some(got) = ch
        .basic_get(
            broker::INTENTS_QUEUE.into(),
            BasicGetOptions { no_ack: false },
        )
        .await
        .unwrap()
    {
        deliveries += 1;
        got.delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await
            .unwrap();
        assert!(
            deliveries < 100,
            "the delivery limit never dead-lettered them"
        );
    }
    let dlq = broker::dead_letter_queue(broker::INTENTS_QUEUE);
    wait_for(
        "the dead letters",
        std::time::Duration::from_secs(20),
        || async { (depth(&ch, &dlq).await == 2).then_some(()) },
    )
    .await;

    let confirmed = ["dead".to_owned(), "made".to_owned()];
    let checked = common::chaos::Invariants::check(&env, &env.store, &confirmed).await;
    assert_eq!(checked.dead, 2);
    assert_eq!(checked.dead_valid, 2, "{checked:?}");
    assert_eq!(checked.dead_valid_with_job, 1, "{checked:?}");
    assert_eq!(checked.lost, vec!["dead".to_owned()], "{checked:?}");
    producer.close().await;
    let _ = amqp.close(200, "done".into()).await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// A dead letter's own headers never choose where its replay goes: anyone who
/// can publish to `onejob.intents` could otherwise plant a letter whose replay
/// publishes a forged `job.succeeded` to `onejob.events`. A replay goes only to
/// the work queue its dead-letter queue belongs to; a letter whose headers name
/// anywhere else is reported, skipped, and left in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_goes_only_to_its_own_work_queue_whatever_the_letter_says() {
    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let amqp = env.amqp().await;
    let (events, events_queue) = env.watch_events(&amqp).await;
    let ch = amqp.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let dlq = broker::dead_letter_queue(broker::INTENTS_QUEUE);
    let forged = serde_json::json!({"type": "job.succeeded", "job_id": uuid::Uuid::now_v7(),
                                     "owner_id": "someone_else", "status": "succeeded"});
    plant(
        &ch,
        &dlq,
        "forged",
        "onejob.events",
        "job.succeeded",
        forged.to_string().into_bytes(),
    )
    .await;
    let honest = serde_json::to_vec(&common::intent("acct_r", "k-honest", "text")).unwrap();
    plant(&ch, &dlq, "honest", "onejob", "intents", honest).await;
    assert_eq!(depth(&ch, &dlq).await, 2);

    let out = env.cli(
        &file.path,
        &["dlq", "replay", &dlq, "--all", "--json", "--reason", "test"],
    );
    assert_eq!(out.status.code(), Some(1), "a skipped letter is a refusal");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["replayed"].as_u64(), report["skipped"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    // Confirmed publishes are routed by the time the command returns.
    assert!(
        env.drain(&events, &events_queue).await.is_empty(),
        "no event was forged"
    );
    assert_eq!(
        depth(&ch, broker::INTENTS_QUEUE).await,
        1,
        "the honest letter went home"
    );
    assert_eq!(
        depth(&ch, &dlq).await,
        1,
        "the forged letter stays, reported"
    );
    let skipped = report["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["letter"]["message_id"] == "forged" || l["message_id"] == "forged")
        .unwrap_or_else(|| panic!("{report}"))
        .to_string();
    assert!(skipped.contains("onejob.intents"), "{skipped}");
    drop(ctx);
}

/// Puts `body` on `dlq` as message `id`, with headers that say it was going
/// to `exchange` with `key`: as anyone who can publish there could.
async fn plant(ch: &lapin::Channel, dlq: &str, id: &str, exchange: &str, key: &str, body: Vec<u8>) {
    use lapin::types::{AMQPValue, FieldTable, LongString};
    let mut headers = FieldTable::default();
    headers.insert(
        "x-onejob-error".into(),
        AMQPValue::LongString(LongString::from("planted")),
    );
    headers.insert(
        "x-onejob-original-exchange".into(),
        AMQPValue::LongString(LongString::from(exchange)),
    );
    headers.insert(
        "x-onejob-original-routing-key".into(),
        AMQPValue::LongString(LongString::from(key)),
    );
    ch.basic_publish(
        "".into(),
        dlq.into(),
        BasicPublishOptions::default(),
        &body,
        lapin::BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(headers),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// `dlq list` racing the reconciler's scans (which take a queue's letters and
/// hand them back at once) still shows every letter: a listing that saw fewer
/// letters than the queue holds once it is done is taken again. And a replay
/// racing them loses nothing: what it did not see this time stays for the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listings_and_replays_racing_the_reconcilers_scans_lose_nothing() {
    let text = config_text("http://127.0.0.1:9/v1", None, "")
        .replace("[worker]\n", "[worker]\ndead_letter_scan = \"10ms\"\n");
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![Role::Reconciler]).await;
    const N: usize = 6;
    for i in 0..N {
        common::console::dead_letter_intent(
            &env,
            &format!("raced-{i}"),
            "acct_r",
            &format!("r-{i}"),
        )
        .await;
    }
    let conn = env.amqp().await;
    let dlq = broker::dead_letter_queue(broker::INTENTS_QUEUE);
    let mut short = 0;
    for _ in 0..40 {
        let seen = onejob::shared::dlq::browse(&conn, &dlq, 100).await.unwrap();
        if seen.len() != N {
            short += 1;
        }
    }
    assert_eq!(
        short, 0,
        "{short} of 40 listings missed letters the scans held"
    );

    // Replays racing the scans: run until every letter has been replayed once.
    let mut replayed = 0;
    for _ in 0..20 {
        let out = json(&env.cli(
            &file.path,
            &["dlq", "replay", "onejob.intents.dlq", "--all", "--json"],
        ));
        replayed += out["replayed"].as_u64().unwrap() as usize;
        if replayed >= N {
            break;
        }
    }
    assert_eq!(replayed, N, "every letter replayed exactly once");
    let ch = conn.create_channel().await.unwrap();
    let intents = depth(&ch, broker::INTENTS_QUEUE).await;
    assert_eq!(
        intents as usize, N,
        "each letter's intent is back in its queue, once"
    );
    fleet.stop().await;
}
