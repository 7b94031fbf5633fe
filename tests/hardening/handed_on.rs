//! Settlements handed on through the broker (issue 39, item 4): an answer
//! whose worker stops while Postgres is unreachable is published, with a
//! confirm, to `onejob.settlements`, and settled by another worker once
//! Postgres is back; a message there that proves no claim settles nothing.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use onejob::broker::{self, SETTLEMENTS_KEY, SETTLEMENTS_QUEUE};
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::fleet::Role;
use onejob::mock::MockOptions;
use serde_json::json;

use super::outages::behind_a_cuttable_postgres;
use crate::common::database::Holder;
use crate::common::{self, P, TestEnv, config, config_for, mock, wait_for, wait_for_status};

/// A worker calls a slow provider; Postgres goes away while the call runs,
/// and the worker is stopped. Its answer can be neither settled nor kept: it
/// is handed on (one message on `onejob.settlements`), the attempt is still
/// `started`, and another worker, with Postgres, settles it with the answer
/// that was paid for: one call, one job, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_held_when_its_worker_stops_with_postgres_down_is_settled_once_it_is_back() {
    let (slow, config, _file, env) = slow_provider(Duration::from_secs(2)).await;
    let (path, ctx) = behind_a_cuttable_postgres(&env, &config).await;
    let shutdown = onejob::edges::shutdown::Shutdown::new();
    let run = tokio::spawn(onejob::fleet::run(
        ctx.clone(),
        vec![Role::Attempts("primary".into())],
        shutdown.clone(),
    ));
    let (job_id, message) = env.admit(&ctx, "acct_h", "stopped", "paid for").await;
    ctx.publish_outbox(&[message]).await.unwrap();
    wait_for("the call to start", Duration::from_secs(20), || async {
        (slow.stats.requests() == 1).then_some(())
    })
    .await;

    path.cut();
    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the worker stops within its grace")
        .unwrap()
        .unwrap();
    let ch = env.amqp().await.create_channel().await.unwrap();
    assert_eq!(
        common::depth(&ch, SETTLEMENTS_QUEUE).await,
        1,
        "the answer is handed on"
    );
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Started);
    assert_eq!(slow.stats.work(), 1);

    let settler = env.fleet(config.clone(), vec![Role::Reconciler]).await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "{:?}", job.attempts);
    assert_eq!(job.completed_by, Some(job.attempts[0].id));
    assert_eq!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: paid for")
    );
    assert!(job.attempts[0].usage.is_some(), "its usage is counted");
    assert_eq!(slow.stats.work(), 1, "the answer was not bought twice");
    assert_eq!(common::depth(&ch, SETTLEMENTS_QUEUE).await, 0);
    let dlq = broker::dead_letter_queue(SETTLEMENTS_QUEUE);
    assert_eq!(common::depth(&ch, &dlq).await, 0);
    settler.stop().await;
    path.restore();
}

/// An answer whose job and attempt rows are both held when it arrives (an
/// operator's session) cannot be settled or kept; when its worker stops, the
/// last settlement hands it on. Another worker's consumer holds it while the
/// rows stay held, and keeps it once they are free: settled, one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_whose_rows_are_held_at_a_stop_is_handed_on_and_settled_once_free() {
    let (slow, config, _file, env) = slow_provider(Duration::from_secs(1)).await;
    let worker = env
        .fleet(config.clone(), vec![Role::Attempts("primary".into())])
        .await;
    let (job_id, message) = env.admit(&worker.ctx, "acct_h", "held", "held rows").await;
    worker.ctx.publish_outbox(&[message]).await.unwrap();
    wait_for("the call to start", Duration::from_secs(20), || async {
        (slow.stats.requests() == 1).then_some(())
    })
    .await;
    let held = Holder::hold_with_attempts(&env.database_url, job_id).await;
    wait_for("the call to end", Duration::from_secs(20), || async {
        (slow.stats.work() == 1).then_some(())
    })
    .await;
    worker.stop().await;
    let ch = env.amqp().await.create_channel().await.unwrap();
    assert_eq!(
        common::depth(&ch, SETTLEMENTS_QUEUE).await,
        1,
        "the answer is handed on"
    );

    let settler = env.fleet(config.clone(), vec![Role::Reconciler]).await;
    wait_for(
        "the settler to hold the settlement while the rows are held",
        Duration::from_secs(20),
        || async {
            (common::queue_counts(&env.name, SETTLEMENTS_QUEUE) == Some((0, 1))).then_some(())
        },
    )
    .await;
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Running, "not settled while held");
    held.release().await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: held rows")
    );
    assert_eq!(slow.stats.work(), 1);
    taken_and_acked(&env, &ch).await;
    settler.stop().await;
}

/// A mock provider that takes `delay` over each call, well within the
/// primary's timeout, and an environment configured for it.
async fn slow_provider(
    delay: Duration,
) -> (
    onejob::mock::MockHandle,
    std::sync::Arc<onejob::settings::config::Config>,
    common::tempfile_path::TempConfig,
    TestEnv,
) {
    let slow = mock(MockOptions {
        delay,
        ..MockOptions::default()
    })
    .await;
    let provider = P("primary", &slow.base_url(), "timeout = \"10s\"");
    let (config, file) = config(&config_for(&[provider], ""));
    let env = TestEnv::new(&config).await;
    (slow, config, file, env)
}

/// What arrives on `onejob.settlements` without the claim its open attempt
/// was started under settles nothing, and is dead-lettered with a reason
/// that says which: not JSON, an unknown field, too large, another claim.
/// The one that names the claim settles the job, whatever headers it
/// carries; sent again, it settles nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_settlement_that_proves_no_claim_settles_nothing() {
    let primary = mock(MockOptions::default()).await;
    let text = config_for(
        &[P(
            "primary",
            &primary.base_url(),
            "max_response_bytes = 1024",
        )],
        "",
    );
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![Role::Reconciler]).await;
    let (job_id, _) = env.admit(&fleet.ctx, "acct_f", "forged", "x").await;
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    let started = env
        .store
        .settle()
        .start("primary", &[job.attempts[0].id], Duration::from_secs(60))
        .await
        .unwrap()
        .remove(0);
    let settlement = |claim| settlement_of(&started, claim);
    let mut extra = settlement(started.claim);
    extra["settled_by"] = json!("me");
    let mut huge = settlement(started.claim);
    huge["request_id"] = json!("x".repeat(200 * 1024));
    let ch = env.amqp().await.create_channel().await.unwrap();
    let dlq = broker::dead_letter_queue(SETTLEMENTS_QUEUE);
    refused_each_with_its_reason(
        &env,
        &ch,
        [
            b"not json".to_vec(),
            serde_json::to_vec(&extra).unwrap(),
            serde_json::to_vec(&huge).unwrap(),
            serde_json::to_vec(&settlement(uuid::Uuid::new_v4())).unwrap(),
        ],
    )
    .await;
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Running, "nothing settled");
    assert!(job.attempts[0].usage.is_none());

    // The claim's own settlement, with forged headers: settled.
    publish(
        &ch,
        &serde_json::to_vec(&settlement(started.claim)).unwrap(),
    )
    .await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.result, Some(json!({"summary": "handed on"})));
    assert_eq!(job.attempts[0].usage, Some(json!({"total_tokens": 7})));
    // Again: acked, settles nothing, refused nowhere.
    publish(
        &ch,
        &serde_json::to_vec(&settlement(started.claim)).unwrap(),
    )
    .await;
    taken_and_acked(&env, &ch).await;
    let again = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(again.version, job.version, "the repeat settled nothing");
    assert_eq!(common::depth(&ch, &dlq).await, 0);
    fleet.stop().await;
}

/// A settlement of `started` with a result and its usage, naming `claim`.
fn settlement_of(started: &onejob::edges::store::Started, claim: uuid::Uuid) -> serde_json::Value {
    json!({
        "attempt_id": started.attempt_id, "job_id": started.job_id, "claim": claim,
        "version": started.version,
        "verdict": {"kind": "succeeded", "detail": {"summary": "handed on"}},
        "usage": {"total_tokens": 7}, "request_id": "chatcmpl-handed-on",
    })
}

/// Waits for the settlements' queue to be empty, nothing held unacked.
async fn taken_and_acked(env: &TestEnv, ch: &lapin::Channel) {
    common::wait_for_depth("taken", Duration::from_secs(20), ch, SETTLEMENTS_QUEUE, 0).await;
    wait_for("acked", Duration::from_secs(20), || async {
        (common::queue_counts(&env.name, SETTLEMENTS_QUEUE) == Some((0, 0))).then_some(())
    })
    .await;
}

/// Publishes `bodies` (not JSON, an unknown field, too large, another
/// claim), and reads each one's reason from the dead-letter queue.
async fn refused_each_with_its_reason(env: &TestEnv, ch: &lapin::Channel, bodies: [Vec<u8>; 4]) {
    for body in bodies {
        publish(ch, &body).await;
    }
    let dlq = broker::dead_letter_queue(SETTLEMENTS_QUEUE);
    common::wait_for_depth("four refusals", Duration::from_secs(20), ch, &dlq, 4).await;
    let reasons: Vec<String> = env
        .drain(ch, &dlq)
        .await
        .iter()
        .map(|d| reason(d.properties.headers().as_ref()))
        .collect();
    // Taken concurrently: each reason once, in any order.
    let once = |what: &str| reasons.iter().filter(|r| r.contains(what)).count() == 1;
    assert!(once("malformed_settlement: expected"), "{reasons:?}");
    assert!(
        once("malformed_settlement: unknown field `settled_by`"),
        "{reasons:?}"
    );
    assert!(once("settlement_too_large: "), "{reasons:?}");
    assert!(
        once("settlement_refused: no attempt ") && once("under the claim it names"),
        "{reasons:?}"
    );
}

/// Publishes `body` to the settlements' routing key, with headers that try
/// to say where it comes from and where it goes.
async fn publish(ch: &lapin::Channel, body: &[u8]) {
    let mut headers = FieldTable::default();
    for (name, value) in [
        (broker::ERROR_HEADER, "forged"),
        ("x-onejob-original-routing-key", "attempts.primary"),
        ("x-onejob-worker", "trusted"),
    ] {
        headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
    }
    let properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_reply_to("onejob.intents".into())
        .with_headers(headers);
    ch.basic_publish(
        broker::EXCHANGE.into(),
        SETTLEMENTS_KEY.into(),
        BasicPublishOptions::default(),
        body,
        properties,
    )
    .await
    .unwrap();
}

/// The reason a dead letter carries.
fn reason(headers: Option<&FieldTable>) -> String {
    headers
        .and_then(|h| broker::header_str(h, broker::ERROR_HEADER))
        .unwrap_or_default()
}
