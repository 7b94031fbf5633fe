//! The measured step: 200 calls that time out at a provider which completes
//! them later, with each kind of evidence. Every job must end without an
//! operator, each request's work must run once at the provider, and no answer
//! may be paid twice; the time from each call's deadline to its resolution is
//! printed (p50, p99) against what it cannot beat: the later of
//! `evidence_delay` and the provider's own completion, past the deadline (the
//! pass runs every second on top). Figures, not assertions: a speed is
//! measured, never asserted in a test.

use std::time::Duration;

use crate::common::{TestEnv, config, intent, mock, wait_for};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use super::{replay_config, stored_config};

/// Intents sent.
const CALLS: usize = 200;
/// The mock's latency; the calls time out at 500 ms.
const LATENCY: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_timed_out_calls_end_from_stored_completions() {
    let options = MockOptions {
        store: true,
        delay: LATENCY,
        ..MockOptions::default()
    };
    measure("stored", options, |base| stored_config(base, "")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_timed_out_calls_end_from_replayed_keys() {
    let options = MockOptions {
        replay: true,
        delay: LATENCY,
        ..MockOptions::default()
    };
    measure("idempotency_key", options, replay_config).await;
}

/// Sends [`CALLS`] intents through a fleet whose provider (the mock, with
/// `options`) answers after [`LATENCY`], checks that each ended once with no
/// operator and one run of its work, and prints the times to resolution.
async fn measure(kind: &str, options: MockOptions, text: impl Fn(&str) -> String) {
    let slow = mock(options).await;
    let (config, _file) = config(&text(&slow.base_url()));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    for i in 0..CALLS {
        let receipt = producer
            .submit(&intent(
                "acct_measure",
                &format!("k-{i}"),
                &format!("call {i}"),
            ))
            .await
            .unwrap();
        assert!(receipt.job_id.is_some());
    }
    wait_for("every job to succeed", Duration::from_secs(300), || async {
        let (ended, jobs): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) FROM jobs",
        )
        .fetch_one(env.store.pool())
        .await
        .unwrap();
        (ended == CALLS as i64 && jobs == CALLS as i64).then_some(())
    })
    .await;
    let (attempts, evidence, operators): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM attempts),
                (SELECT count(*) FROM audit WHERE actor = 'evidence'),
                (SELECT count(*) FROM audit WHERE actor <> 'evidence')",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert_eq!(
        attempts, CALLS as i64,
        "one attempt per job, none paid twice"
    );
    assert_eq!(operators, 0, "no operator");
    assert_eq!(evidence, CALLS as i64, "each settled by evidence, once");
    assert_eq!(
        slow.stats.work(),
        CALLS as u64,
        "each request's work ran once"
    );
    let mut waits: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM au.at - a.deadline_at)::float8
         FROM audit au JOIN attempts a ON a.id = au.attempt_id
         WHERE au.actor = 'evidence'",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    waits.sort_by(f64::total_cmp);
    let at = |q: f64| waits[((waits.len() - 1) as f64 * q).round() as usize];
    // A call times out at 500 ms and the provider completes it 500 ms later;
    // the first look comes evidence_delay (1 s) after the deadline.
    let floor = f64::max(1.0, LATENCY.as_secs_f64() - 0.5);
    println!(
        "evidence ({kind}): {CALLS} calls timed out, {} ended without an operator, {} settled by evidence, \
         the provider's work run {} times; \
         time from deadline to resolution p50 {:.2} s, p99 {:.2} s, max {:.2} s \
         (the later of evidence_delay and the provider's completion: {floor:.2} s; the pass runs every second)",
        CALLS,
        evidence,
        slow.stats.work(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
    producer.close().await;
    fleet.stop().await;
}
