//! Chaos: three worker processes and two producers under fire. Intents (30% of
//! them duplicates) flow through a mock provider with random latency and errors
//! while a random worker is killed with SIGKILL every couple of seconds (and
//! restarted, as an orchestrator would), RabbitMQ is restarted once and Postgres
//! once, and Postgres is also down once for longer than the delivery limit (1
//! here) times the minute a worker used to retry before it handed deliveries
//! back. Then an invariant checker asserts contract section 5 and prints the
//! counts.
//!
//! It restarts a RabbitMQ node and a Postgres server of its own (a one-node
//! `scripts/cluster` and an `initdb` directory on free ports), never the
//! machine's, and stops and removes them at the end. It is heavy and
//! timing-sensitive, so it runs alone: nextest's default filter leaves it out,
//! and `scripts/test` runs it before the rest. `ONEJOB_CHAOS_INTENTS` and `ONEJOB_CHAOS_SECONDS` size it (CI: 1500 over
//! 30 s), and `ONEJOB_CHAOS_PG_OUTAGE` is the long outage in seconds (CI: 70); the
//! book (docs/src/operations/chaos.md) gives a full run's figures.

use onejob_test_support as common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::chaos::{Invariants, Sent, Workers, env_or, settle, start_producers};
use common::throwaway::{OwnPostgres, OwnRabbit};
use common::{P, Servers, TestEnv, config, config_for, mock};
use onejob::mock::MockOptions;
use rand::Rng;

/// The servers this test restarts: its own.
struct Own {
    postgres: Arc<OwnPostgres>,
    rabbit: Arc<OwnRabbit>,
}

/// The fire, for `run_for`: kill a random worker every 1-3 s; restart RabbitMQ
/// at 30% of the run and Postgres at 60%; stop Postgres for `outage` at 45%,
/// with no kill meanwhile (a killed worker hands its deliveries back, which
/// counts against their limit whatever the worker does: this fault is the
/// outage alone).
async fn fire(workers: &mut Workers, servers: &Own, run_for: Duration, outage: Duration) {
    let start = Instant::now();
    let (mut rabbit_done, mut pg_done, mut outage_done) = (false, false, false);
    while start.elapsed() < run_for {
        let pause = rand::rng().random_range(1000..3000);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let victim = rand::rng().random_range(0..3);
        workers.kill_one(victim);
        if !rabbit_done && start.elapsed() > run_for * 3 / 10 {
            rabbit_done = true;
            let rabbit = servers.rabbit.clone();
            tokio::task::spawn_blocking(move || rabbit.script(&["restart-app", "1"]))
                .await
                .unwrap();
        }
        if !outage_done && start.elapsed() > run_for * 45 / 100 {
            outage_done = true;
            let postgres = servers.postgres.clone();
            tokio::task::spawn_blocking(move || postgres.halt())
                .await
                .unwrap();
            tokio::time::sleep(outage).await;
            let postgres = servers.postgres.clone();
            tokio::task::spawn_blocking(move || postgres.begin())
                .await
                .unwrap();
        }
        if !pg_done && start.elapsed() > run_for * 6 / 10 {
            pg_done = true;
            let postgres = servers.postgres.clone();
            tokio::task::spawn_blocking(move || postgres.restart())
                .await
                .unwrap();
        }
        workers.supervise();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_loses_nothing_and_duplicates_nothing() {
    let intents = env_or("ONEJOB_CHAOS_INTENTS", 1500);
    let seconds = env_or("ONEJOB_CHAOS_SECONDS", 30) as u64;
    let outage = Duration::from_secs(env_or("ONEJOB_CHAOS_PG_OUTAGE", 70) as u64);
    // The provider's concurrency in the test configuration: calls one worker has
    // in flight at most.
    let concurrency = 8;
    let primary = mock(MockOptions {
        jitter: Duration::from_millis(150),
        error_rate: 0.1,
        ..MockOptions::default()
    })
    .await;
    let url = primary.base_url();
    let text = config_for(&[P("primary", &url, "timeout = \"2s\"")], "").replace(
        "[worker]\n",
        "[worker]\nstuck_after = \"5s\"\nmax_republish = 5\nintake_prefetch = 64\ndelivery_limit = 1\ndead_letter_scan = \"2s\"\n",
    );
    let (config, file) = config(&text);
    let own = Own {
        postgres: Arc::new(OwnPostgres::start()),
        rabbit: Arc::new(OwnRabbit::start(1)),
    };
    let env = TestEnv::on(&config, Servers::own(&own.postgres, &own.rabbit)).await;

    let amqp = env.amqp_url.clone();
    let mut workers = Workers::start(3, &env, &file.path, move |_| amqp.clone());

    // Two producers: every intent is published until the broker confirms it,
    // reconnecting through the broker restart. 30% are re-sends of an earlier key.
    let sent = Sent::default();
    let producers = start_producers(2, intents, seconds, |_| env.amqp_url.clone(), &sent);

    fire(&mut workers, &own, Duration::from_secs(seconds), outage).await;
    for p in producers {
        p.await.unwrap();
    }
    let kills_and_crashes = workers.deaths;

    // Recovery: the workers keep running (restarted if they exit) until no job is
    // queued or running, or two minutes pass.
    let store = common::chaos::store(&env, &config).await;
    let confirmed = sent.keys();
    let settle_time = settle(&store, &mut workers, confirmed.len()).await;
    let log_dir = workers.stop();

    println!(
        "chaos: {} intents sent ({} distinct keys confirmed) by 2 producers to 3 workers over {seconds}s; \
         {kills_and_crashes} worker deaths (SIGKILL or exit), RabbitMQ and Postgres restarted once each, \
         Postgres down once for {}s (delivery limit 1); settled in {:.1}s (logs in {})",
        sent.count.load(std::sync::atomic::Ordering::Relaxed),
        confirmed.len(),
        outage.as_secs(),
        settle_time.as_secs_f64(),
        log_dir.display()
    );
    Invariants::check(&env, &store, &confirmed)
        .await
        .assert_held(
            "chaos",
            primary.stats.requests(),
            kills_and_crashes * concurrency,
        );
    common::history::History::check(&store, &primary.stats.idempotency_keys())
        .await
        .assert_held("chaos", kills_and_crashes * concurrency);
    common::chaos::remove_logs(&log_dir);
}
