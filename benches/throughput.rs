//! Throughput, as ratios against baselines measured in the same run on the same
//! services, never as bare seconds to compare across machines:
//!
//! - **intake** against a raw AMQP round trip: the same producer, the same queue
//!   and prefetch, but an echo consumer that answers each intent with a receipt
//!   (confirmed) and does nothing else. The ratio is what admitting a job costs.
//! - **admit** against raw single-row `INSERT … ON CONFLICT DO NOTHING` into a
//!   copy of the jobs table, with the same concurrency; and admit in batches of
//!   100 against admit one by one: what batching buys.
//! - **end to end** (intent to succeeded job, through a zero-latency mock
//!   provider) against the same AMQP baseline.
//!
//! `cargo bench --bench throughput` (`ONEJOB_BENCH_N` intents per phase, default
//! 2000). It prints; it asserts nothing.

use onejob_test_support as common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TestEnv, config, config_text, intent, mock};
use futures_util::StreamExt;
use onejob::domain::{JobId, JobStatus};
use onejob::edges::shutdown::Shutdown;
use onejob::edges::store::NewJob;
use onejob::fleet::Role;
use onejob::intent::{Outcome, Receipt};
use onejob::mock::MockOptions;
use onejob::settings::config::Config;
use onejob::shared::runtime;
use onejob_producer::{Producer, ProducerOptions};

/// Requests kept in flight by the client side of every phase.
const IN_FLIGHT: usize = 64;

fn n() -> usize {
    std::env::var("ONEJOB_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

/// Runs `op(i)` for `0..count` with `IN_FLIGHT` at a time; returns per second.
async fn rate<F, Fut>(count: usize, op: F) -> f64
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    futures_util::stream::iter(0..count)
        .map(op)
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<()>>()
        .await;
    count as f64 / start.elapsed().as_secs_f64()
}

/// Submits `count` intents keyed `<prefix>-<i>`, `IN_FLIGHT` at a time; each
/// receipt must come, with the `expected` outcome if one is given. Per second.
async fn submit_all(
    producer: &Producer,
    count: usize,
    prefix: &str,
    expected: Option<Outcome>,
) -> f64 {
    rate(count, |i| async move {
        let r = producer
            .submit(&intent("bench", &format!("{prefix}-{i}"), "x"))
            .await;
        let outcome = r.as_ref().map(|receipt| receipt.outcome);
        assert!(
            outcome.is_ok() && expected.is_none_or(|e| outcome.as_ref().ok() == Some(&e)),
            "{prefix}-{i}: {r:?}"
        );
    })
    .await
}

fn line(what: &str, per_second: f64, unit: &str, ratio: Option<(f64, &str)>) {
    let ratio = ratio.map_or("(baseline)".to_owned(), |(base, of)| {
        format!("{:.2}× {of}", per_second / base)
    });
    println!("bench: {what:<52} {per_second:>9.0} {unit:<7} {ratio}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let count = n();
    let primary = mock(MockOptions::default()).await;
    // The test configuration, with room for as many provider calls in flight as
    // the client keeps requests in flight.
    let text = config_text(&primary.base_url(), None, "")
        .replace("concurrency = 8", &format!("concurrency = {IN_FLIGHT}"));
    let (config, _file) = config(&text);
    println!(
        "bench: {count} per phase, {IN_FLIGHT} in flight, on this machine's PostgreSQL and RabbitMQ"
    );

    let amqp_baseline = amqp_round_trip(&config, count).await;
    line(
        "AMQP round trip, echo consumer",
        amqp_baseline,
        "msg/s",
        None,
    );
    intake(&config, count, amqp_baseline).await;
    admission(&config, count).await;
    end_to_end(&config, count, amqp_baseline).await;
    drop(primary);
}

/// Baseline: the AMQP round trip alone, through an echo consumer. Per second.
async fn amqp_round_trip(config: &Arc<Config>, count: usize) -> f64 {
    let env = TestEnv::new(config).await;
    let ctx = env.context(config.clone()).await;
    let shutdown = Shutdown::new();
    let echo_ctx = ctx.clone();
    let echo_stop = shutdown.clone();
    let echo = tokio::spawn(async move {
        let prefetch = echo_ctx.config.worker.intake_prefetch;
        let inner = echo_ctx.clone();
        runtime::consume(
            &echo_ctx,
            onejob::broker::INTENTS_QUEUE,
            prefetch,
            &echo_stop,
            move |d| {
                let ctx = inner.clone();
                async move {
                    let receipt = Receipt::for_job(Outcome::Created, JobId::new());
                    let body = serde_json::to_vec(&receipt).unwrap_or_default();
                    let mut props = onejob::broker::json_properties();
                    if let Some(id) = d.properties.correlation_id() {
                        props = props.with_correlation_id(id.clone());
                    }
                    if let Some(reply_to) = d.properties.reply_to() {
                        let _ = ctx
                            .publisher
                            .publish("", reply_to.as_str(), &body, props, false)
                            .await;
                    }
                    let _ = runtime::ack(&d).await;
                }
            },
        )
        .await
    });
    let producer = producer(&env.amqp_url).await;
    let per_second = submit_all(&producer, count, "echo", None).await;
    shutdown.trigger();
    let _ = echo.await;
    producer.close().await;
    per_second
}

/// Intake: the same round trip, with a job admitted (and its first attempt
/// published) before each receipt.
async fn intake(config: &Arc<Config>, count: usize, amqp_baseline: f64) {
    let env = TestEnv::new(config).await;
    let fleet = env.fleet(config.clone(), vec![Role::Intake]).await;
    let producer = producer(&env.amqp_url).await;
    // The same keys twice: first each is created, then a duplicate, which
    // takes the same path without the insert.
    for (what, unit, expected) in [
        ("intake: intent → job → receipt", "jobs/s", Outcome::Created),
        (
            "intake: a duplicate → its receipt",
            "/s",
            Outcome::Duplicate,
        ),
    ] {
        let per_second = submit_all(&producer, count, "in", Some(expected)).await;
        line(
            what,
            per_second,
            unit,
            Some((amqp_baseline, "AMQP round trip")),
        );
    }
    producer.close().await;
    fleet.stop().await;
}

/// Admission against raw inserts, and batches against single rows.
async fn admission(config: &Arc<Config>, count: usize) {
    let env = TestEnv::new(config).await;
    let pool = env.store.pool();
    sqlx::query("CREATE TABLE bench_jobs (LIKE jobs INCLUDING ALL)")
        .execute(pool)
        .await
        .unwrap();
    let raw = rate(count, |i| async move {
        sqlx::query(
            "INSERT INTO bench_jobs (id, owner_id, idempotency_key, request_fingerprint, operation, input, status)
             VALUES ($1, 'bench', $2, 'f', 'summarize', '{}', 'queued')
             ON CONFLICT DO NOTHING",
        )
        .bind(uuid::Uuid::now_v7())
        .bind(format!("raw-{i}"))
        .execute(pool)
        .await
        .unwrap();
    })
    .await;
    line(
        "raw INSERT … ON CONFLICT, one row a statement",
        raw,
        "rows/s",
        None,
    );
    let single = rate(count, |i| {
        let job = common::new_job("bench", &format!("one-{i}"), "x");
        let store = &env.store;
        async move {
            store.admission().admit(&[job]).await.unwrap();
        }
    })
    .await;
    line(
        "store.admit, one intent a call (job + attempt + outbox)",
        single,
        "jobs/s",
        Some((raw, "raw INSERT")),
    );
    let batches = count.div_ceil(100);
    let batched = rate(batches, |b| {
        let jobs: Vec<NewJob> = (0..100)
            .map(|j| common::new_job("bench", &format!("batch-{b}-{j}"), "x"))
            .collect();
        let store = &env.store;
        async move {
            store.admission().admit(&jobs).await.unwrap();
        }
    })
    .await
        * 100.0;
    line(
        "store.admit, batches of 100",
        batched,
        "jobs/s",
        Some((single, "one a call")),
    );
}

/// End to end: intent to succeeded job through the zero-latency mock.
async fn end_to_end(config: &Arc<Config>, count: usize, amqp_baseline: f64) {
    let env = TestEnv::new(config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = producer(&env.amqp_url).await;
    let start = Instant::now();
    submit_all(&producer, count, "e2e", None).await;
    let want = i64::try_from(count).unwrap_or(i64::MAX);
    loop {
        let (done,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs WHERE status = $1")
            .bind(JobStatus::Succeeded.as_str())
            .fetch_one(env.store.pool())
            .await
            .unwrap();
        if done >= want {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(600),
            "jobs did not finish: {done}/{want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let per_second = count as f64 / start.elapsed().as_secs_f64();
    line(
        "end to end: intent → succeeded job",
        per_second,
        "jobs/s",
        Some((amqp_baseline, "AMQP round trip")),
    );
    producer.close().await;
    fleet.stop().await;
}

async fn producer(amqp_url: &str) -> Producer {
    Producer::connect_with(
        amqp_url,
        ProducerOptions {
            receipt_timeout: Duration::from_secs(120),
            ..ProducerOptions::default()
        },
    )
    .await
    .expect("producer connects")
}
