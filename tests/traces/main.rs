//! W3C trace context across the hops: a publisher's (or an HTTP caller's)
//! `traceparent` continues through intake, the attempt message and the
//! provider call to the job's event; without one, onejob starts a trace; a
//! malformed one is never passed on. `export` checks the spans sent over OTLP.

use onejob_test_support as common;
mod export;

use std::time::Duration;

use common::{TestEnv, config, config_text, intent, mock, wait_for, wait_for_status};
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use onejob::domain::{JobId, JobStatus};
use onejob::mock::{MockHandle, MockOptions, TraceSeen};
use onejob::trace::TraceContext;
use onejob_producer::Producer;

/// The context a publisher with a tracing system of its own would send.
const UPSTREAM: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn upstream() -> TraceContext {
    TraceContext::parse(UPSTREAM, Some("vendor=abc")).unwrap()
}

/// The mock, a fleet of every role on it with the test's database and vhost,
/// a broker connection of the test's own, and the configuration's file.
async fn traced() -> (
    MockHandle,
    TestEnv,
    common::Fleet,
    lapin::Connection,
    common::tempfile_path::TempConfig,
) {
    let provider = mock(MockOptions::default()).await;
    let (config, file) = config(&config_text(&provider.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let amqp = env.amqp().await;
    (provider, env, fleet, amqp, file)
}

/// What the provider saw of the call made for `job`'s only attempt.
async fn call_seen(env: &TestEnv, provider: &MockHandle, job: JobId) -> TraceSeen {
    let job = env.store.jobs().job(job).await.unwrap().unwrap();
    assert_eq!(job.attempts.len(), 1, "{job:?}");
    let attempt = job.attempts[0].id.to_string();
    let seen = provider.stats.traces();
    seen.into_iter()
        .find(|t| t.idempotency_key.as_deref() == Some(attempt.as_str()))
        .unwrap_or_else(|| panic!("the provider saw no call for attempt {attempt}"))
}

/// The trace context in the call's headers, which must be valid.
fn context_of(seen: &TraceSeen) -> TraceContext {
    let parent = seen.traceparent.as_deref().expect("a traceparent header");
    TraceContext::parse(parent, seen.tracestate.as_deref())
        .unwrap_or_else(|| panic!("an invalid traceparent reached the provider: {parent:?}"))
}

/// The trace context on the job's event, once every outbox row is published.
async fn event_context(
    env: &TestEnv,
    fleet: &common::Fleet,
    events: &lapin::Channel,
    queue: &str,
) -> TraceContext {
    let got = common::events_once_settled(env, &fleet.ctx, events, queue).await;
    assert_eq!(got.len(), 1, "one event");
    TraceContext::from_headers(got[0].properties.headers().as_ref())
        .expect("the event carries a valid traceparent")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publishers_trace_reaches_the_provider_and_the_event() {
    let (provider, env, fleet, amqp, _config) = traced().await;
    let (events, queue) = env.watch_events(&amqp).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let receipt = producer
        .submit_in_trace(&intent("acct_t", "k", "traced"), &upstream())
        .await
        .unwrap();
    let job = receipt.job_id.unwrap();
    wait_for_status(&env, job, JobStatus::Succeeded).await;

    let call = context_of(&call_seen(&env, &provider, job).await);
    assert_eq!(call.trace_id, upstream().trace_id, "the publisher's trace");
    assert_ne!(
        call.span_id,
        upstream().span_id,
        "each hop has its own span"
    );
    assert_eq!(
        call.state.as_deref(),
        Some("vendor=abc"),
        "tracestate passes on"
    );
    let event = event_context(&env, &fleet, &events, &queue).await;
    assert_eq!(event.trace_id, upstream().trace_id);
    assert_eq!(event.state.as_deref(), Some("vendor=abc"));
    let stored: Option<String> = sqlx::query_scalar("SELECT traceparent FROM jobs WHERE id = $1")
        .bind(job.0)
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    let stored = TraceContext::parse(&stored.expect("the job keeps its trace"), None).unwrap();
    assert_eq!(stored.trace_id, upstream().trace_id);
    assert_eq!(
        event.span_id, stored.span_id,
        "the event names the job's intake span as its parent"
    );
    producer.close().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_trace_onejob_starts_one_per_job() {
    let (provider, env, fleet, amqp, _config) = traced().await;
    let (events, queue) = env.watch_events(&amqp).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let first = common::submit(&producer, "acct_t", "one", "untraced").await;
    wait_for_status(&env, first, JobStatus::Succeeded).await;
    let call = context_of(&call_seen(&env, &provider, first).await);
    assert_eq!(call.flags & 1, 1, "a trace onejob starts is sampled");
    assert_eq!(call.state, None);
    let event = event_context(&env, &fleet, &events, &queue).await;
    assert_eq!(
        event.trace_id, call.trace_id,
        "one trace from intake to event"
    );

    let second = common::submit(&producer, "acct_t", "two", "untraced").await;
    wait_for_status(&env, second, JobStatus::Succeeded).await;
    let other = context_of(&call_seen(&env, &provider, second).await);
    assert_ne!(other.trace_id, call.trace_id, "each job a trace of its own");
    producer.close().await;
    fleet.stop().await;
}

/// Publishes an intent with the given trace headers, as any AMQP client could.
async fn publish_with_headers(amqp: &lapin::Connection, key: &str, headers: &[(&str, &str)]) {
    let mut table = FieldTable::default();
    for (name, value) in headers {
        table.insert(
            (*name).into(),
            AMQPValue::LongString(LongString::from(*value)),
        );
    }
    let body = serde_json::to_vec(&intent("acct_t", key, "hostile")).unwrap();
    let ch = amqp.create_channel().await.unwrap();
    ch.basic_publish(
        onejob::broker::EXCHANGE.into(),
        onejob::broker::INTENTS_KEY.into(),
        BasicPublishOptions::default(),
        &body,
        onejob::broker::json_properties().with_headers(table),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// The job `key` became, once it succeeded.
async fn job_by_key(env: &TestEnv, key: &str) -> JobId {
    let id = wait_for("the job", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, uuid::Uuid>(
            "SELECT id FROM jobs WHERE owner_id = 'acct_t' AND idempotency_key = $1",
        )
        .bind(key)
        .fetch_optional(env.store.pool())
        .await
        .unwrap()
    })
    .await;
    wait_for_status(env, JobId(id), JobStatus::Succeeded).await;
    JobId(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_malformed_trace_is_replaced_and_a_bad_tracestate_dropped() {
    let (provider, env, fleet, amqp, _config) = traced().await;

    let forged = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01\r\nx-evil: 1";
    publish_with_headers(
        &amqp,
        "forged",
        &[("traceparent", forged), ("tracestate", "a=b")],
    )
    .await;
    let job = job_by_key(&env, "forged").await;
    let seen = call_seen(&env, &provider, job).await;
    let call = context_of(&seen);
    assert_ne!(
        call.trace_id,
        upstream().trace_id,
        "a new trace, not the forged one"
    );
    assert_eq!(seen.tracestate, None, "no state without its traceparent");

    let state = "a=b\u{1b}[2J";
    publish_with_headers(
        &amqp,
        "state",
        &[("traceparent", UPSTREAM), ("tracestate", state)],
    )
    .await;
    let job = job_by_key(&env, "state").await;
    let seen = call_seen(&env, &provider, job).await;
    assert_eq!(context_of(&seen).trace_id, upstream().trace_id);
    assert_eq!(
        seen.tracestate, None,
        "a tracestate with a control character is dropped"
    );
    fleet.stop().await;
}
