//! Cluster chaos: three worker processes, each connected first to a different
//! node of a three-node RabbitMQ cluster (`scripts/cluster`), and two producers,
//! each given the nodes in another order. Intents (30% of them duplicates) flow
//! through a mock provider with random latency and errors while the node that
//! leads `onejob.intents` is killed with SIGKILL, later restarted, and then a
//! follower is killed. The invariant checker of the chaos test then asserts
//! contract section 5, the history check reads the provider's log against the
//! database, and the test prints how long each node loss stalled intake.
//!
//! Each test starts a cluster of its own beside the machine's RabbitMQ (its own
//! directory, node names and free ports; the machine's node is never touched)
//! and stops it again at the end. It loads the machine's two cores, so it runs alone, like the
//! chaos test: nextest's default filter leaves it out and `scripts/test` runs it
//! after the chaos test. `ONEJOB_CLUSTER_CHAOS_INTENTS` and `ONEJOB_CLUSTER_CHAOS_SECONDS` size
//! it (CI: 1,000 over 30 s); the book
//! (docs/src/operations/cluster.md) gives a full run's figures.

use onejob_test_support as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::chaos::{Invariants, Sent, Workers, env_or, settle, start_producers};
use common::throwaway::{Nodes, OwnRabbit};
use common::{P, Servers, TestEnv, config, config_for, mock};
use onejob::edges::shutdown::Shutdown;
use onejob::mock::MockOptions;
use onejob::settings::config::Config;

/// Worker processes, one per node.
const WORKERS: usize = 3;

/// The node (1-3) that leads `queue` in `vhost`.
fn leader(nodes: &Nodes, queue: &str, vhost: &str) -> usize {
    nodes
        .script(&["leader", queue, vhost])
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("no leader for {queue}"))
}

/// The longest pause in admissions from `from` (seconds since the epoch) over
/// the next `window`: how long intake stalled after a fault.
async fn stall(store: &onejob::edges::store::Store, from: f64, window: f64) -> Duration {
    let times: Vec<(f64,)> = sqlx::query_as(
        "SELECT extract(epoch FROM created_at)::float8 FROM jobs \
         WHERE created_at >= to_timestamp($1) AND created_at < to_timestamp($2) ORDER BY created_at",
    )
    .bind(from)
    .bind(from + window)
    .fetch_all(store.pool())
    .await
    .unwrap();
    if times.is_empty() {
        // Nothing admitted at all: stalled for the whole window (at least).
        return Duration::from_secs_f64(window);
    }
    let mut last = from;
    let mut longest: f64 = 0.0;
    for (t,) in times {
        longest = longest.max(t - last);
        last = t;
    }
    Duration::from_secs_f64(longest)
}

fn epoch_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_node_lost_loses_nothing_and_duplicates_nothing() {
    let intents = env_or("ONEJOB_CLUSTER_CHAOS_INTENTS", 1000);
    let seconds = env_or("ONEJOB_CLUSTER_CHAOS_SECONDS", 30) as u64;
    let concurrency = 8;

    let began = Instant::now();
    let cluster = OwnRabbit::start(3);
    println!(
        "cluster chaos: three-node cluster up in {:.1}s",
        began.elapsed().as_secs_f64()
    );

    let primary = mock(MockOptions {
        jitter: Duration::from_millis(150),
        error_rate: 0.1,
        ..MockOptions::default()
    })
    .await;
    let (config, file) = config(&chaos_config(&primary.base_url()));
    let mut env = TestEnv::on(&config, Servers::with_rabbit(&cluster)).await;
    env.amqp_url = cluster.urls_from(0, &env.name);

    // Worker i connects first to node i; the producers to nodes 2 and 3.
    let (vhost, nodes) = (env.name.clone(), Nodes::clone(&cluster));
    let mut workers = Workers::start(WORKERS, &env, &file.path, move |i| {
        nodes.urls_from(i as u16, &vhost)
    });
    let sent = Sent::default();
    // They publish over the whole run (start_producers spreads the intents over
    // 60% of the time it is given), so that every fault meets traffic.
    let producers = start_producers(
        2,
        intents,
        seconds * 10 / 6,
        |p| cluster.urls_from(p as u16 + 1, &env.name),
        &sent,
    );
    let store = common::chaos::store(&env, &config).await;

    // Every queue the workers declared (each through its own node, at once) is
    // replicated on the three nodes.
    replicated_on_three_nodes(&cluster, &env.name).await;

    let faults = the_fire(&mut workers, &cluster, &env.name, seconds).await;
    for p in producers {
        p.await.unwrap();
    }
    workers.supervise();

    let kills_and_crashes = workers.deaths;
    let confirmed = sent.keys();
    let settle_time = settle(&store, &mut workers, confirmed.len()).await;
    let reconnects: usize = (0..WORKERS).map(|i| workers.connections(i)).sum();
    let log_dir = workers.stop();

    println!(
        "cluster chaos: {} intents sent ({} distinct keys confirmed) by 2 producers to 3 workers on 3 nodes over {seconds}s; \
         {kills_and_crashes} worker exits; the workers opened {reconnects} connections (3 at the start); settled in {:.1}s (logs in {})",
        sent.count.load(std::sync::atomic::Ordering::Relaxed),
        confirmed.len(),
        settle_time.as_secs_f64(),
        log_dir.display()
    );
    print_stalls_and_storage(&store, &faults).await;
    // Calls in flight at the faults: a node loss kills no worker, but each of
    // the three may have had `concurrency` calls running when its connection
    // went; any worker exit counts too.
    let bound = (faults.len() * WORKERS + kills_and_crashes) * concurrency;
    Invariants::check(&env, &store, &confirmed)
        .await
        .assert_held("cluster chaos", primary.stats.requests(), bound);
    common::history::History::check(&store, &primary.stats.idempotency_keys())
        .await
        .assert_held("cluster chaos", bound);
    common::chaos::remove_logs(&log_dir);
}

/// The configuration of the node-loss test: the provider at `provider_url`
/// with a 2 s timeout; attempts stuck after 5 s and republished 5 times at
/// most, 64 intents prefetched, a delivery limit of 1.
fn chaos_config(provider_url: &str) -> String {
    config_for(
        &[P("primary", provider_url, "timeout = \"2s\"")],
        "",
    )
    .replace(
        "[worker]\n",
        "[worker]\nstuck_after = \"5s\"\nmax_republish = 5\nintake_prefetch = 64\ndelivery_limit = 1\n",
    )
}

/// Waits until every queue the workers declare is replicated on the three
/// nodes.
async fn replicated_on_three_nodes(nodes: &Nodes, vhost: &str) {
    for queue in [
        "onejob.intents",
        "onejob.intents.dlq",
        "onejob.settlements",
        "onejob.settlements.dlq",
        "onejob.attempts.primary",
        "onejob.attempts.primary.dlq",
    ] {
        let vhost = vhost.to_owned();
        common::wait_for(
            &format!("{queue} replicated on three nodes"),
            Duration::from_secs(60),
            || {
                let (vhost, nodes) = (vhost.clone(), nodes.clone());
                async move {
                    let members = tokio::task::spawn_blocking(move || {
                        nodes
                            .script(&["members", queue, &vhost])
                            .parse::<usize>()
                            .ok()
                    })
                    .await
                    .unwrap();
                    (members == Some(3)).then_some(())
                }
            },
        )
        .await;
    }
}

/// The faults, timed over the run of `seconds`: each as what happened and
/// when (seconds since the epoch).
async fn the_fire(
    workers: &mut Workers,
    cluster: &Nodes,
    vhost_name: &str,
    seconds: u64,
) -> Vec<(String, f64)> {
    // The fire: at 25% of the run the leader of onejob.intents is killed; at 50%
    // it is restarted; at 70% a follower is killed, and at 90% restarted, so
    // that the cluster ends whole.
    let start = Instant::now();
    let at = |share: u32| Duration::from_secs(seconds) * share / 100;
    let mut faults: Vec<(String, f64)> = Vec::new();
    let wait_until = |t: Duration| async move {
        while start.elapsed() < t {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    wait_until(at(25)).await;
    let (vhost, nodes) = (vhost_name.to_owned(), cluster.clone());
    let led = blocking(move || leader(&nodes, "onejob.intents", &vhost)).await;
    faults.push((
        format!("leader of onejob.intents (node {led}) killed"),
        epoch_now(),
    ));
    // Worker i connected to node i + 1 first: the one on the killed node must
    // move to another.
    moved(workers, cluster, led - 1, led, 2).await;
    wait_until(at(50)).await;
    workers.supervise();
    let nodes = cluster.clone();
    blocking(move || nodes.script(&["restart", &led.to_string()])).await;
    wait_until(at(70)).await;
    workers.supervise();
    let (vhost, nodes) = (vhost_name.to_owned(), cluster.clone());
    let now_leads = blocking(move || leader(&nodes, "onejob.intents", &vhost)).await;
    // A follower that still has the worker that connected to it first (not the
    // node killed before, whose worker moved on), so that the loss moves one.
    let follower = (1..=3)
        .find(|n| *n != now_leads && *n != led)
        .or_else(|| (1..=3).find(|n| *n != now_leads))
        .unwrap();
    faults.push((format!("follower (node {follower}) killed"), epoch_now()));
    let before = workers.connections(follower - 1);
    moved(workers, cluster, follower - 1, follower, before + 1).await;
    wait_until(at(90)).await;
    workers.supervise();
    let nodes = cluster.clone();
    blocking(move || nodes.script(&["restart", &follower.to_string()])).await;
    faults
}

/// How long intake stalled after each fault, and what a job costs to keep.
async fn print_stalls_and_storage(store: &onejob::edges::store::Store, faults: &[(String, f64)]) {
    for (fault, when) in faults {
        let stalled = stall(store, *when, 5.0).await;
        println!(
            "cluster chaos: {fault}: intake stalled {:.2}s (the longest pause in admissions over the next 5 s)",
            stalled.as_secs_f64()
        );
    }
    // What a job costs to keep, for the book's note on one Postgres primary.
    let (jobs, job_bytes, attempt_bytes, outbox_bytes): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM jobs), pg_total_relation_size('jobs'), \
                pg_total_relation_size('attempts'), pg_total_relation_size('outbox')",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    let per_job = |bytes: i64| bytes / jobs.max(1);
    println!(
        "cluster chaos: storage per job, indexes included: jobs {} B, attempts {} B, outbox {} B ({jobs} jobs)",
        per_job(job_bytes),
        per_job(attempt_bytes),
        per_job(outbox_bytes)
    );
}

/// Runs blocking work (a `scripts/cluster` call, which takes a second or so)
/// off the runtime's threads, so that the producers and the timing go on.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// Kills node `node` and waits until worker `worker` (connected to it) has
/// opened its `connections`-th connection, on another node: the failover
/// itself, within 30 s.
async fn moved(
    workers: &mut Workers,
    cluster: &Nodes,
    worker: usize,
    node: usize,
    connections: usize,
) {
    let nodes = cluster.clone();
    blocking(move || nodes.script(&["kill", &node.to_string()])).await;
    let began = Instant::now();
    while workers.connections(worker) < connections {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "worker {worker} did not reconnect to another node within 30 s of node {node}'s loss (logs in {})",
            workers.log_dir.display()
        );
        workers.supervise();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "cluster chaos: node {node} killed; worker {worker} reconnected to another node after {:.2}s",
        began.elapsed().as_secs_f64()
    );
}

/// A Postgres outage longer than the broker's `consumer_timeout` (30 minutes
/// by default; 3 s on the throwaway cluster here, checked every second): the
/// broker takes back the intents a worker holds through the outage, closing
/// its channel, again and again, past the intents' delivery limit. Nothing is
/// lost and nothing is admitted twice: once Postgres is back every intent is
/// one job, and the worker, restarted when a role stops as an orchestrator
/// would restart it, goes on taking intents.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_postgres_outage_past_the_consumer_timeout_loses_nothing() {
    onejob::edges::telemetry::init_quiet();
    let cluster = OwnRabbit::start(3);
    cluster.script(&["consumer-timeout", "3000"]);

    let primary = mock(MockOptions::default()).await;
    let text = config_for(&[P("primary", &primary.base_url(), "")], "").replace(
        "[worker]\n",
        "[worker]\ndelivery_limit = 2\ndead_letter_scan = \"1s\"\n",
    );
    let (config, _file) = config(&text);
    let mut env = TestEnv::on(&config, Servers::with_rabbit(&cluster)).await;
    env.amqp_url = cluster.urls_from(0, &env.name);
    let path = common::lossy::LossyPostgres::to(&common::database::pg_server(), 1, 0).await;
    let database_url = path.url(&env.name);

    // The worker, restarted whenever it stops (as an orchestrator would).
    let shutdown = Shutdown::new();
    let restarts = Arc::new(AtomicUsize::new(0));
    let supervisor = supervised_worker(&config, &env.amqp_url, database_url, &shutdown, &restarts);

    let producer = onejob_producer::Producer::connect_with(
        &env.amqp_url,
        onejob_producer::ProducerOptions {
            receipt_timeout: Duration::from_secs(30),
            delivery_limit: config.worker.delivery_limit,
        },
    )
    .await
    .unwrap();
    let first = common::submit(&producer, "acct_o", "before", "before the outage").await;
    common::wait_for_status(&env, first, onejob::domain::JobStatus::Succeeded).await;

    // The outage: intents arrive, the worker holds them, the broker takes them
    // back every 3 s, for 15 s (five timeouts, past the delivery limit of 2).
    path.go_down();
    const N: usize = 10;
    for i in 0..N {
        let intent = common::intent("acct_o", &format!("during-{i}"), "during the outage");
        producer.publish_only(&intent).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(15)).await;
    path.come_up();

    common::wait_for(
        "every intent to be one job",
        Duration::from_secs(120),
        || async {
            let (jobs, succeeded): (i64, i64) = sqlx::query_as(
                "SELECT count(*), count(*) FILTER (WHERE status = 'succeeded') FROM jobs
             WHERE idempotency_key LIKE 'during-%'",
            )
            .fetch_one(env.store.pool())
            .await
            .unwrap();
            (jobs == N as i64 && succeeded == N as i64).then_some(())
        },
    )
    .await;
    // And the worker still takes intents.
    let after = common::submit(&producer, "acct_o", "after", "after the outage").await;
    common::wait_for_status(&env, after, onejob::domain::JobStatus::Succeeded).await;
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, N as i64 + 2, "one job per intent, none twice");
    let restarted = restarts.load(Ordering::SeqCst);
    println!(
        "consumer timeout: {N} intents held through a 15 s Postgres outage under a 3 s consumer timeout: {N} jobs; the worker restarted {restarted} time(s)"
    );
    // A restart may cut off the calls of one worker (8 at most).
    common::history::History::check(&env.store, &primary.stats.idempotency_keys())
        .await
        .assert_held("consumer timeout", restarted * 8);
    shutdown.trigger();
    let _ = supervisor.await;
    producer.close().await;
}

/// Runs a worker with every role until `shutdown`, starting it again (after
/// half a second) whenever it stops, as an orchestrator would, and counting
/// the restarts.
fn supervised_worker(
    config: &Arc<Config>,
    amqp_url: &str,
    database_url: String,
    shutdown: &Shutdown,
    restarts: &Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<()> {
    let (config, amqp, shutdown, restarts) = (
        config.clone(),
        amqp_url.to_owned(),
        shutdown.clone(),
        restarts.clone(),
    );
    tokio::spawn(async move {
        while !shutdown.is_triggered() {
            // Each run has its own shutdown: a worker that stops a failed
            // role stops the rest of itself, not the test.
            let run = Shutdown::new();
            match onejob::shared::runtime::Context::connect(config.clone(), &database_url, &amqp)
                .await
            {
                Ok(ctx) => {
                    let connection = ctx.connection.clone();
                    let worker = onejob::fleet::run(ctx, vec![], run.clone());
                    tokio::pin!(worker);
                    let ended = tokio::select! {
                        ended = &mut worker => ended,
                        () = shutdown.wait() => {
                            run.trigger();
                            worker.await
                        }
                    };
                    // As the worker's binary does: what it held goes back at
                    // once, and no consumer of it lives on.
                    let _ = connection.close(200, "worker stopped".into()).await;
                    if let Err(e) = ended {
                        println!("consumer timeout: the worker stopped: {e}");
                    }
                }
                Err(e) => println!("consumer timeout: the worker cannot start: {e}"),
            }
            if !shutdown.is_triggered() {
                restarts.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    })
}
