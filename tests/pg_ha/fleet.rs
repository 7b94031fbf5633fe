//! onejob through a failover of the primary, under load.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use onejob::edges::shutdown::Shutdown;
use onejob::settings::config::Config;
use onejob_test_support::chaos::{Invariants, Sent, env_or, start_producers};
use onejob_test_support::pg_ha::{OwnHa, installed};
use onejob_test_support::{P, Servers, TestEnv, config, config_for, mock, wait_for};
use sqlx::{Connection, PgConnection};
use tokio::task::JoinHandle;

/// How the primary fails, as `scripts/pg-ha` does it to its node.
#[derive(Clone, Copy, Debug)]
enum Failure {
    /// SIGKILL its Patroni and PostgreSQL at once, as a machine's crash
    /// would: the standby is promoted once the leader key expires.
    Crash,
    /// SIGKILL its PostgreSQL only: Patroni starts it again and keeps the
    /// lead, with no failover.
    KillPostgres,
    /// Stop its Patroni as an operator would (SIGTERM): Patroni stops its
    /// PostgreSQL and gives up the lead, and the standby is promoted.
    StopPatroni,
    /// SIGKILL its Patroni only: its PostgreSQL runs on as a primary no one
    /// reaches (HAProxy's check fails), and the standby is promoted once the
    /// leader key expires.
    KillPatroni,
}

impl Failure {
    fn command(self) -> &'static str {
        match self {
            Failure::Crash => "crash",
            Failure::KillPostgres => "kill",
            Failure::StopPatroni => "stop-patroni",
            Failure::KillPatroni => "kill-patroni",
        }
    }

    /// Whether another node takes the lead.
    fn fails_over(self) -> bool {
        !matches!(self, Failure::KillPostgres)
    }
}

/// onejob through a failover: two workers (every role) reach PostgreSQL
/// through HAProxy while intents flow (30% re-sent) and calls are in flight
/// at a provider that keeps its completions; the primary's machine crashes
/// early in the load, and intents flow on through the failover and after it.
/// With synchronous replication, afterwards: every confirmed intent is one
/// job, and ended; no attempt's provider was called twice; nothing is left
/// unknown or started; every event is published; the workers stopped
/// without an error; and the history check against the provider's log holds.
/// `ONEJOB_PGHA_INTENTS` and `ONEJOB_PGHA_SECONDS` size it (300 over 25 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_through_a_primary_crash_loses_nothing_and_calls_nothing_twice() {
    through(
        "a_fleet_through_a_primary_crash_loses_nothing_and_calls_nothing_twice",
        Failure::Crash,
    )
    .await;
}

/// The same, the primary's PostgreSQL killed (SIGKILL) while its Patroni
/// lives: Patroni restarts it (crash recovery) on the same node, and
/// onejob's connections, cut mid-transaction, come back to it by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_through_a_killed_primary_postgres_loses_nothing_and_calls_nothing_twice() {
    through(
        "a_fleet_through_a_killed_primary_postgres_loses_nothing_and_calls_nothing_twice",
        Failure::KillPostgres,
    )
    .await;
}

/// The same, the primary's Patroni stopped as an operator would: it stops
/// its PostgreSQL and hands the lead over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_through_a_stopped_primary_patroni_loses_nothing_and_calls_nothing_twice() {
    through(
        "a_fleet_through_a_stopped_primary_patroni_loses_nothing_and_calls_nothing_twice",
        Failure::StopPatroni,
    )
    .await;
}

/// The same, the primary's Patroni killed (SIGKILL) while its PostgreSQL
/// runs on: HAProxy stops routing to it and cuts its sessions, so nothing
/// commits on the old primary once the standby is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_through_a_killed_primary_patroni_loses_nothing_and_calls_nothing_twice() {
    through(
        "a_fleet_through_a_killed_primary_patroni_loses_nothing_and_calls_nothing_twice",
        Failure::KillPatroni,
    )
    .await;
}

/// One run: the fleet under load, the primary failed as `failure` says
/// early in it, and the checks.
async fn through(test: &str, failure: Failure) {
    if !installed(test) {
        return;
    }
    let intents = env_or("ONEJOB_PGHA_INTENTS", 300);
    let seconds = env_or("ONEJOB_PGHA_SECONDS", 25) as u64;
    let ha = OwnHa::start(true);
    let provider = mock(onejob::mock::MockOptions {
        jitter: Duration::from_millis(100),
        store: true,
        ..onejob::mock::MockOptions::default()
    })
    .await;
    let kept = "timeout = \"2s\"\nevidence = \"stored\"\nevidence_delay = \"1s\"\nevidence_deadline = \"30s\"";
    // The chaos producers declare the intents queue with a delivery limit of 1.
    let text = config_for(&[P("primary", &provider.base_url(), kept)], "")
        .replace("[worker]\n", "[worker]\ndelivery_limit = 1\n");
    let (config, _file) = config(&text);
    let servers = Servers {
        postgres: ha.base_url(),
        rabbit: None,
    };
    let env = TestEnv::on(&config, servers).await;
    let workers = start_workers(&config, &env).await;
    let sent = Sent::default();
    let amqp = env.amqp_url.clone();
    let producers = start_producers(2, intents, seconds, |_| amqp.clone(), &sent);
    // Early in the load, the primary fails.
    tokio::time::sleep(Duration::from_secs(seconds / 10)).await;
    let old = ha.primary();
    let sent_before = sent.count.load(Ordering::SeqCst);
    ha.script(&[failure.command(), &old.to_string()]);
    let failed = Instant::now();
    let new = ha.wait_primary(if failure.fails_over() { old } else { 0 });
    let outage = failed.elapsed();
    let sent_during = sent.count.load(Ordering::SeqCst) - sent_before;
    for producer in producers {
        producer.await.expect("producer");
    }
    let confirmed = sent.keys();
    let sent_all = sent.count.load(Ordering::SeqCst);
    assert!(
        sent_before > 0 && sent_during > 0 && sent_all > sent_before + sent_during,
        "intents flowed before, during and after the failure: {sent_before}, {sent_during}, {sent_all}"
    );
    wait_for(
        "every job to end after the failure",
        Duration::from_secs(120),
        || all_ended(&env.database_url, confirmed.len()),
    )
    .await;
    stop_workers(workers).await;
    println!(
        "pg {failure:?}: node {old} failed, node {new} took writes through HAProxy after {outage:?}; \
         {sent_all} intents sent ({sent_before} before the failure, {sent_during} until a primary took writes; {} keys)",
        confirmed.len(),
    );
    check_history(&env, &config, &provider, &confirmed).await;
}

/// Two in-process workers, every role, their PostgreSQL through HAProxy.
async fn start_workers(
    config: &Arc<Config>,
    env: &TestEnv,
) -> Vec<(
    Shutdown,
    JoinHandle<Result<(), onejob::shared::runtime::WorkerError>>,
)> {
    let mut workers = Vec::new();
    for _ in 0..2 {
        let ctx = onejob::shared::runtime::Context::connect(
            config.clone(),
            &env.database_url,
            &env.amqp_url,
        )
        .await
        .expect("worker context");
        let shutdown = Shutdown::new();
        let task = tokio::spawn(onejob::fleet::run(ctx, vec![], shutdown.clone()));
        workers.push((shutdown, task));
    }
    workers
}

/// Stops the workers; each must have run without an error.
async fn stop_workers(
    workers: Vec<(
        Shutdown,
        JoinHandle<Result<(), onejob::shared::runtime::WorkerError>>,
    )>,
) {
    for (shutdown, task) in workers {
        shutdown.trigger();
        let ran = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("worker stops")
            .expect("worker task");
        assert!(ran.is_ok(), "a worker stopped with an error: {ran:?}");
    }
}

/// Some when every confirmed key has a job, none is open, and every outbox
/// row is published; read on a connection of its own each time (one made
/// before the failover is cut by it).
async fn all_ended(database_url: &str, confirmed: usize) -> Option<()> {
    let mut db = PgConnection::connect(database_url).await.ok()?;
    let (open, jobs, pending): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM jobs WHERE status IN ('queued', 'running', 'unknown')),
                (SELECT count(*) FROM jobs),
                (SELECT count(*) FROM outbox WHERE published_at IS NULL)",
    )
    .fetch_one(&mut db)
    .await
    .ok()?;
    (open == 0 && pending == 0 && jobs as usize >= confirmed).then_some(())
}

/// The chaos tests' invariants, and the history check against the
/// provider's log; no attempt's provider called twice.
async fn check_history(
    env: &TestEnv,
    config: &Config,
    provider: &onejob::mock::MockHandle,
    confirmed: &[String],
) {
    let store = onejob_test_support::chaos::store(env, config).await;
    let invariants = Invariants::check(env, &store, confirmed).await;
    let calls = provider.stats.idempotency_keys();
    let distinct: HashSet<&String> = calls.iter().collect();
    invariants.assert_held("pg failover", calls.len() as u64, 0);
    onejob_test_support::history::History::check(&store, &calls)
        .await
        .assert_held("pg failover", 0);
    assert_eq!(
        calls.len(),
        distinct.len(),
        "no attempt's provider called twice"
    );
}
