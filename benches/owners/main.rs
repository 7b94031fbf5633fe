//! Owners sharing one provider: does one owner's flood hold another owner's
//! jobs back? One provider with 32 call slots answering in 200 ms (160 calls
//! a second), owner B publishing 2 intents a second throughout:
//!
//! 1. **alone**: B's latency with nobody else on the provider;
//! 2. **flood**: owner A publishes `ONEJOB_BENCH_FLOOD` intents at once
//!    (10,000 by default) while B goes on; B's latency again, and A's
//!    throughput against the provider's capacity;
//! 3. **budget**: owner C, with a budget of ten jobs' reservations, sends a
//!    burst of 200 intents at once; what its calls spent against its budget
//!    (the overshoot, goal 0), and what a job reserved against what its call
//!    spent (the estimate's error) (`budget.rs`).
//!
//! B's latency is reported twice: from publishing to the job's success (what
//! B sees: A's flood passes through intake first, which admits it at its own
//! rate) and from admission to success (the provider's queue and slots
//! alone). The goals (issue 30): the flood raises B's p99 by at most one call
//! and 50 ms, and A gets at least 0.9 of the provider's capacity.
//!
//! `cargo bench --bench owners`. It prints; it asserts nothing.

mod budget;
use onejob_test_support as common;

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::{TestEnv, config, config_text, intent, mock};
use futures_util::StreamExt;
use onejob::domain::JobId;
use onejob::mock::MockOptions;
use onejob_producer::{Producer, ProducerOptions};

/// The provider's call slots.
const SLOTS: usize = 32;
/// How long each call takes.
const CALL: Duration = Duration::from_millis(200);
/// B's intents a second.
const B_RATE: f64 = 2.0;
/// How long B runs alone.
const ALONE: Duration = Duration::from_secs(20);

fn flood() -> usize {
    std::env::var("ONEJOB_BENCH_FLOOD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// One of B's jobs: when it was published, admitted and finished.
struct Timed {
    published: DateTime<Utc>,
    created: DateTime<Utc>,
    finished: DateTime<Utc>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let provider = mock(MockOptions {
        delay: CALL,
        ..MockOptions::default()
    })
    .await;
    let text = config_text(&provider.base_url(), None, "")
        .replace("concurrency = 8", &format!("concurrency = {SLOTS}"))
        .replace(
            "temperature = 0.0\n",
            "temperature = 0.0\nmax_tokens = 16\n",
        );
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect_with(
        &env.amqp_url,
        ProducerOptions {
            receipt_timeout: Duration::from_secs(300),
            ..ProducerOptions::default()
        },
    )
    .await
    .expect("producer connects");
    let capacity = SLOTS as f64 / CALL.as_secs_f64();
    let n = flood();
    println!(
        "bench owners: {SLOTS} slots, {} ms calls ({capacity:.0} calls/s); B at {B_RATE}/s; A floods {n}",
        CALL.as_millis()
    );

    let alone = owner_b(&env, &producer, "alone", Some(ALONE), None).await;
    let started = Instant::now();
    let (flooded, a_done) = tokio::join!(
        owner_b(&env, &producer, "flood", None, Some(n)),
        owner_a(&env, &producer, n),
    );
    let a_rate = n as f64 / a_done.as_secs_f64();
    println!("flood done in {:.1} s", started.elapsed().as_secs_f64());

    report("B alone", &alone);
    report("B during A's flood", &flooded);
    let raise = |f: fn(&Timed) -> f64| p(&flooded, 0.99, f) - p(&alone, 0.99, f);
    println!(
        "p99 raise, published → done: {:.0} ms; admitted → done: {:.0} ms (goal: ≤ {} ms)",
        raise(from_publish) * 1000.0,
        raise(from_admission) * 1000.0,
        CALL.as_millis() + 50
    );
    println!(
        "A: {n} jobs in {:.1} s = {a_rate:.1} jobs/s = {:.2} of the provider's capacity (goal ≥ 0.9)",
        a_done.as_secs_f64(),
        a_rate / capacity
    );
    budget::budget(&env, &producer, &config).await;
    producer.close().await;
    fleet.stop().await;
}

fn from_publish(t: &Timed) -> f64 {
    (t.finished - t.published).num_microseconds().unwrap_or(0) as f64 / 1e6
}

fn from_admission(t: &Timed) -> f64 {
    (t.finished - t.created).num_microseconds().unwrap_or(0) as f64 / 1e6
}

/// The `q` quantile of `f` over `jobs`, in seconds.
fn p(jobs: &[Timed], q: f64, f: fn(&Timed) -> f64) -> f64 {
    let mut v: Vec<f64> = jobs.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len().max(1)) - 1;
    v.get(i).copied().unwrap_or(f64::NAN)
}

fn report(what: &str, jobs: &[Timed]) {
    println!(
        "{what}: {} jobs; published → done p50 {:.0} ms, p99 {:.0} ms; admitted → done p50 {:.0} ms, p99 {:.0} ms",
        jobs.len(),
        p(jobs, 0.5, from_publish) * 1000.0,
        p(jobs, 0.99, from_publish) * 1000.0,
        p(jobs, 0.5, from_admission) * 1000.0,
        p(jobs, 0.99, from_admission) * 1000.0,
    );
}

/// Owner B: an intent every 1/`B_RATE` s (each published without waiting for
/// the one before), for `for_how_long`, or until A's `n` jobs have all ended;
/// each job timed once it succeeded.
async fn owner_b(
    env: &TestEnv,
    producer: &Producer,
    phase: &str,
    for_how_long: Option<Duration>,
    until_a_ends: Option<usize>,
) -> Vec<Timed> {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / B_RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ticks = futures_util::stream::unfold((0usize, tick), |(i, mut tick)| async move {
        tick.tick().await;
        let over = for_how_long.is_some_and(|d| start.elapsed() >= d);
        let a_ended = match until_a_ends {
            Some(n) if i % 4 == 0 => ended(env, "acct_a").await >= n,
            _ => false,
        };
        (!over && !a_ended).then_some((i, (i + 1, tick)))
    });
    let published: Vec<(JobId, DateTime<Utc>)> = ticks
        .map(|i| async move {
            let at = Utc::now();
            let key = format!("{phase}-{i}");
            let receipt = producer
                .submit(&intent("acct_b", &key, "b"))
                .await
                .expect("B's intent");
            (receipt.job_id.expect("B's job"), at)
        })
        .buffer_unordered(10_000)
        .collect()
        .await;
    let mut timed = Vec::new();
    for (job, at) in published {
        timed.push(finished(env, job, at).await);
    }
    timed
}

/// Owner A: `n` intents at once; how long from the first publish until all
/// its jobs ended.
async fn owner_a(env: &TestEnv, producer: &Producer, n: usize) -> Duration {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let start = Instant::now();
    futures_util::stream::iter(0..n)
        .map(|i| async move {
            producer
                .submit(&intent("acct_a", &format!("a-{i}"), "a"))
                .await
                .expect("A's intent");
        })
        .buffer_unordered(512)
        .collect::<Vec<()>>()
        .await;
    while ended(env, "acct_a").await < n {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

/// The owner's jobs that ended.
async fn ended(env: &TestEnv, owner: &str) -> usize {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE owner_id = $1 AND status IN ('succeeded', 'failed', 'cancelled')",
    )
    .bind(owner)
    .fetch_one(env.store.pool())
    .await
    .expect("count jobs");
    usize::try_from(n).unwrap_or(0)
}

/// Waits for B's job to succeed; its times.
async fn finished(env: &TestEnv, job: JobId, published: DateTime<Utc>) -> Timed {
    loop {
        let j = env
            .store
            .jobs()
            .job(job)
            .await
            .expect("read job")
            .expect("job");
        if j.status == onejob::domain::JobStatus::Succeeded {
            return Timed {
                published,
                created: j.created_at,
                finished: j.updated_at,
            };
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
