//! The database's everyday faults at once, under load: see the test.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{P, TestEnv, config, config_for, mock, wait_for};
use onejob::mock::MockOptions;
use sqlx::{Connection, Executor, PgConnection};

/// Chaos of the database's everyday faults, through three in-process workers
/// under load: replies lost after Postgres ran a statement (one committed
/// reply in 20 through the workers' path), and job rows held by another
/// session for 1.5 s at a time under a database-wide `lock_timeout` of
/// 300 ms, while intents (30% of them re-sent) flow through a provider with
/// random latency and errors. Then the chaos test's invariant checker: 0 lost,
/// 0 stuck, 0 unknown; and every attempt's provider was called at most once.
/// `ONEJOB_DB_CHAOS_INTENTS` and `ONEJOB_DB_CHAOS_SECONDS` size it (600 over
/// 15 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_chaos_loses_nothing_duplicates_no_call_and_leaves_nothing_unknown() {
    use common::chaos::{Invariants, Sent, env_or, start_producers};
    use rand::Rng;

    let intents = env_or("ONEJOB_DB_CHAOS_INTENTS", 600);
    let seconds = env_or("ONEJOB_DB_CHAOS_SECONDS", 15) as u64;
    let primary = mock(MockOptions {
        jitter: Duration::from_millis(150),
        error_rate: 0.1,
        ..MockOptions::default()
    })
    .await;
    let text = config_for(&[P("primary", &primary.base_url(), "timeout = \"5s\"")], "").replace(
        "[worker]\n",
        "[worker]\nstuck_after = \"5s\"\nmax_republish = 5\ndelivery_limit = 1\n",
    );
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    common::database::set_lock_timeout(&env).await;
    let server = common::database::pg_server();
    let lossy = common::lossy::LossyPostgres::to(&server, 20, u64::MAX).await;
    let mut fleets = Vec::new();
    for _ in 0..3 {
        let ctx =
            onejob::runtime::Context::connect(config.clone(), &lossy.url(&env.name), &env.amqp_url)
                .await
                .expect("worker context");
        let shutdown = onejob::shutdown::Shutdown::new();
        let task = tokio::spawn(onejob::fleet::run(ctx, vec![], shutdown.clone()));
        fleets.push((shutdown, task));
    }
    lossy.start_losing();

    // Another session holds a random open job's row now and then.
    let holding = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let holds = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let holder = {
        let (url, holding, holds) = (env.database_url.clone(), holding.clone(), holds.clone());
        tokio::spawn(async move {
            let mut conn = PgConnection::connect(&url).await.unwrap();
            while holding.load(std::sync::atomic::Ordering::SeqCst) {
                conn.execute("BEGIN").await.unwrap();
                let picked: Option<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM jobs WHERE status IN ('queued', 'running')
                     ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED",
                )
                .fetch_optional(&mut conn)
                .await
                .unwrap();
                if picked.is_some() {
                    holds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(1500)).await;
                conn.execute("COMMIT").await.unwrap();
                let pause = rand::rng().random_range(100..400);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
        })
    };

    let sent = Sent::default();
    let amqp = env.amqp_url.clone();
    for producer in start_producers(2, intents, seconds, |_| amqp.clone(), &sent) {
        producer.await.expect("producer");
    }
    let confirmed = sent.keys();

    // Settled: every confirmed key has a job, and none is queued or running.
    let recovery = std::time::Instant::now();
    wait_for("every job to end", Duration::from_secs(120), || async {
        let (open, jobs): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status IN ('queued', 'running')), count(*) FROM jobs",
        )
        .fetch_one(env.store.pool())
        .await
        .unwrap();
        (open == 0 && jobs as usize >= confirmed.len()).then_some(())
    })
    .await;
    let settled_in = recovery.elapsed();
    holding.store(false, std::sync::atomic::Ordering::SeqCst);
    holder.await.unwrap();
    let lost_replies = lossy.lost();
    lossy.stop_losing();
    // The last events' outbox rows are published by the relay.
    wait_for("the outbox to drain", Duration::from_secs(30), || async {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                .fetch_one(env.store.pool())
                .await
                .unwrap();
        (pending == 0).then_some(())
    })
    .await;
    for (shutdown, task) in fleets {
        shutdown.trigger();
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("worker stops")
            .expect("worker task")
            .expect("worker ran without errors");
    }

    let held_rows = holds.load(std::sync::atomic::Ordering::SeqCst);
    assert!(lost_replies >= 10, "replies were lost: {lost_replies}");
    assert!(held_rows >= 3, "job rows were held: {held_rows}");
    let invariants = Invariants::check(&env, &env.store, &confirmed).await;
    let calls = primary.stats.idempotency_keys();
    let distinct: std::collections::HashSet<&String> = calls.iter().collect();
    let without_call: i64 =
        sqlx::query_scalar("SELECT count(*) FROM attempts WHERE status IN ('started', 'unknown')")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    println!(
        "database chaos: {} intents sent ({} keys), {lost_replies} replies lost after commits, \
         {held_rows} job rows held 1.5 s under lock_timeout 300 ms; settled {settled_in:?} after the last publish; \
         {} provider calls for {} attempts, {} called twice; {without_call} attempts started or unknown",
        sent.count.load(std::sync::atomic::Ordering::SeqCst),
        confirmed.len(),
        calls.len(),
        invariants.attempts,
        calls.len() - distinct.len(),
    );
    invariants.assert_held("database chaos", calls.len() as u64, 0);
    assert_eq!(
        calls.len(),
        distinct.len(),
        "no attempt's provider called twice"
    );
    assert_eq!(without_call, 0, "no attempt left started or unknown");
}
