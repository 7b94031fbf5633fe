//! The database's everyday faults at once, under load: see the test.

use onejob_test_support as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::{P, TestEnv, config, config_for, mock, wait_for};
use onejob::edges::shutdown::Shutdown;
use onejob::mock::MockOptions;
use onejob::settings::config::Config;
use sqlx::{Connection, Executor, PgConnection};
use tokio::task::JoinHandle;

/// Chaos of the database's everyday faults, through three in-process workers
/// under load: replies lost after Postgres ran a statement (one committed
/// reply in 20 through the workers' path), and job rows (open or `unknown`)
/// held by another session for 1.5 s at a time under a database-wide
/// `lock_timeout` of 300 ms, while intents (30% of them re-sent) flow
/// through a provider with random latency (a third of the calls time out,
/// and the completions it stored settle them) and errors, for an owner with
/// `max_in_flight`. Then the chaos test's invariant checker: 0 lost, 0
/// stuck, 0 unknown; every attempt's provider called at most once; and the
/// history check against the provider's log.
/// `ONEJOB_DB_CHAOS_INTENTS` and `ONEJOB_DB_CHAOS_SECONDS` size it (600 over
/// 15 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_chaos_loses_nothing_duplicates_no_call_and_leaves_nothing_unknown() {
    use common::chaos::{Sent, env_or, start_producers};

    let intents = env_or("ONEJOB_DB_CHAOS_INTENTS", 600);
    let seconds = env_or("ONEJOB_DB_CHAOS_SECONDS", 15) as u64;
    let primary = mock(MockOptions {
        jitter: Duration::from_millis(300),
        error_rate: 0.1,
        store: true,
        ..MockOptions::default()
    })
    .await;
    let text = chaos_config(&primary.base_url());
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    common::database::set_lock_timeout(&env).await;
    let server = common::database::pg_server();
    let lossy = common::lossy::LossyPostgres::to(&server, 20, u64::MAX).await;
    let fleets = Fleets::start(&config, &lossy.url(&env.name), &env.amqp_url).await;
    lossy.start_losing();

    // Another session holds a random open job's row now and then.
    let holder = RowHolder::start(&env.database_url);

    let sent = Sent::default();
    let amqp = env.amqp_url.clone();
    for producer in start_producers(2, intents, seconds, |_| amqp.clone(), &sent) {
        producer.await.expect("producer");
    }
    let confirmed = sent.keys();

    // The faults last as long as the load; then the fleet recovers.
    let held_rows = holder.stop().await;
    let settled_in = settled(&env, confirmed.len()).await;
    lossy.stop_losing();
    let lost = Lost::of(&lossy.lost_statements());
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
    fleets.stop().await;
    check_history(
        &env,
        &primary,
        &sent,
        &confirmed,
        (lost, held_rows, settled_in),
    )
    .await;
}

/// The replies lost after commits, by what they answered: claims,
/// settlements, and everything else (reads, the relay, the passes).
#[derive(Debug, Default)]
struct Lost {
    claims: usize,
    settlements: usize,
    other: usize,
}

impl Lost {
    /// Sorts the lost replies by the statements they answered.
    fn of(lost: &[Vec<String>]) -> Lost {
        let mut sorted = Lost::default();
        for statements in lost {
            let ran = |what: &str| statements.iter().any(|s| s.contains(what));
            if ran("SET status = 'started', claim") {
                sorted.claims += 1;
            } else if ran("jobs_taken") {
                sorted.settlements += 1;
            } else {
                sorted.other += 1;
            }
        }
        sorted
    }
}

/// The times the workers' claims and settlements met a row held under
/// another session's lock, by their own counters (the workers run in this
/// process): `(claims, settlements)`.
fn collisions() -> (u64, u64) {
    let text = onejob::edges::metrics::render();
    let sum = |name: &str, label: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    (
        sum("onejob_attempt_claims_held_total{", ""),
        sum("onejob_attempts_settled_total{", "settled=\"busy\""),
    )
}

/// The three in-process workers, each with every role, their Postgres
/// connections through `database_url`.
struct Fleets(
    Vec<(
        Shutdown,
        JoinHandle<Result<(), onejob::shared::runtime::WorkerError>>,
    )>,
);

impl Fleets {
    async fn start(config: &Arc<Config>, database_url: &str, amqp_url: &str) -> Fleets {
        let mut fleets = Vec::new();
        for _ in 0..3 {
            let ctx =
                onejob::shared::runtime::Context::connect(config.clone(), database_url, amqp_url)
                    .await
                    .expect("worker context");
            let shutdown = Shutdown::new();
            let task = tokio::spawn(onejob::fleet::run(ctx, vec![], shutdown.clone()));
            fleets.push((shutdown, task));
        }
        Fleets(fleets)
    }

    async fn stop(self) {
        for (shutdown, task) in self.0 {
            shutdown.trigger();
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("worker stops")
                .expect("worker task")
                .expect("worker ran without errors");
        }
    }
}

/// The queued job whose claim comes next: a turn handed out, else the next
/// in line (a random queued job is most likely deep in the owner's held
/// line, and no claim would meet it while it is held).
const NEXT_TO_START: &str = "SELECT j.id FROM turns t
    JOIN attempts a ON a.id = t.attempt_id JOIN jobs j ON j.id = a.job_id
    WHERE j.status = 'queued'
    ORDER BY t.handed_out_at IS NULL, t.seq LIMIT 1 FOR UPDATE OF j SKIP LOCKED";
/// A running job with a call in flight, whose settlement is about to meet
/// it (a running job whose next attempt waits its turn has none: retries
/// take turns, and an owner's wait for room under `max_in_flight`).
const RANDOM_RUNNING: &str = "SELECT j.id FROM jobs j WHERE j.status = 'running'
      AND EXISTS (SELECT 1 FROM attempts a WHERE a.job_id = j.id AND a.status = 'started')
    ORDER BY random() LIMIT 1 FOR UPDATE OF j SKIP LOCKED";
/// An unknown job, whose evidence is about to meet it.
const RANDOM_UNKNOWN: &str = "SELECT id FROM jobs WHERE status = 'unknown'
    ORDER BY random() LIMIT 1 FOR UPDATE SKIP LOCKED";

/// Another session that holds open jobs' rows (the queued one whose claim
/// comes next, a running and an unknown one picked at random) for 1.5 s at a time, until stopped, counting
/// the rows it held.
struct RowHolder {
    holding: Arc<AtomicBool>,
    holds: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl RowHolder {
    fn start(database_url: &str) -> RowHolder {
        use rand::Rng;

        let holding = Arc::new(AtomicBool::new(true));
        let holds = Arc::new(AtomicU64::new(0));
        let task = {
            let (url, holding, holds) = (database_url.to_owned(), holding.clone(), holds.clone());
            tokio::spawn(async move {
                let mut conn = PgConnection::connect(&url).await.unwrap();
                while holding.load(Ordering::SeqCst) {
                    conn.execute("BEGIN").await.unwrap();
                    // One job of each open status, where there is one: a
                    // queued one's claim, a running one's settlement and an
                    // unknown one's evidence are about to meet it.
                    let mut held = 0;
                    for pick in [NEXT_TO_START, RANDOM_RUNNING, RANDOM_UNKNOWN] {
                        let picked: Option<uuid::Uuid> = sqlx::query_scalar(pick)
                            .fetch_optional(&mut conn)
                            .await
                            .unwrap();
                        held += u64::from(picked.is_some());
                    }
                    holds.fetch_add(held, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    conn.execute("COMMIT").await.unwrap();
                    let pause = rand::rng().random_range(100..400);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
            })
        };
        RowHolder {
            holding,
            holds,
            task,
        }
    }

    /// Stops holding rows, and says how many it held.
    async fn stop(self) -> u64 {
        self.holding.store(false, Ordering::SeqCst);
        self.task.await.unwrap();
        self.holds.load(Ordering::SeqCst)
    }
}

/// Waits until every confirmed key has a job and none is queued, running or
/// unknown (evidence settles the unknowns), and says how long that took.
async fn settled(env: &TestEnv, confirmed: usize) -> Duration {
    let recovery = std::time::Instant::now();
    wait_for("every job to end", Duration::from_secs(120), || async {
        let (open, jobs): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status IN ('queued', 'running', 'unknown')), count(*) FROM jobs",
        )
        .fetch_one(env.store.pool())
        .await
        .unwrap();
        (open == 0 && jobs as usize >= confirmed).then_some(())
    })
    .await;
    recovery.elapsed()
}

/// The run's configuration: calls past 200 ms time out, and their attempts
/// are `unknown` until the completions the provider (at `base`) stored
/// settle them (one answered with an error stored none: by the deadline it
/// fails `no_evidence`, and the route moves on); one owner may have 8 calls
/// in flight, unknowns included.
fn chaos_config(base: &str) -> String {
    let provider = "timeout = \"200ms\"\nevidence = \"stored\"\nevidence_delay = \"1s\"\nevidence_deadline = \"3s\"";
    config_for(&[P("primary", base, provider)], "").replace(
        "[worker]\n",
        "[worker]\nstuck_after = \"5s\"\nmax_republish = 5\ndelivery_limit = 1\n",
    ) + "\n[owners]\nmax_in_flight = 8\n"
}

/// What the run left, against the provider's log: the figures printed, the
/// invariants and the history asserted.
async fn check_history(
    env: &TestEnv,
    primary: &onejob::mock::MockHandle,
    sent: &common::chaos::Sent,
    confirmed: &[String],
    (lost, held_rows, settled_in): (Lost, u64, Duration),
) {
    use common::chaos::Invariants;
    let (claims_held, settlements_held) = collisions();
    let invariants = Invariants::check(env, &env.store, confirmed).await;
    let calls = primary.stats.idempotency_keys();
    let distinct: std::collections::HashSet<&String> = calls.iter().collect();
    let by_evidence: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit WHERE actor = 'evidence'")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    let without_call: i64 =
        sqlx::query_scalar("SELECT count(*) FROM attempts WHERE status IN ('started', 'unknown')")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    println!(
        "database chaos: {} intents sent ({} keys); replies lost after commits: {} to claims, \
         {} to settlements, {} to other statements; {held_rows} job rows held 1.5 s under \
         lock_timeout 300 ms, met by {claims_held} claims and {settlements_held} settlements; \
         {by_evidence} unknowns settled by evidence; \
         settled {settled_in:?} after the last publish; \
         {} provider calls for {} attempts, {} called twice; {without_call} attempts started or unknown",
        sent.count.load(Ordering::SeqCst),
        confirmed.len(),
        lost.claims,
        lost.settlements,
        lost.other,
        calls.len(),
        invariants.attempts,
        calls.len() - distinct.len(),
    );
    assert!(
        lost.claims >= 1 && lost.settlements >= 1,
        "replies to claims and settlements were lost: {lost:?}"
    );
    assert!(
        claims_held >= 1 && settlements_held >= 1,
        "claims and settlements met held rows: {claims_held} claims, {settlements_held} settlements"
    );
    assert!(
        by_evidence >= 10,
        "calls timed out and evidence settled them: {by_evidence}"
    );
    invariants.assert_held("database chaos", calls.len() as u64, 0);
    common::history::History::check(&env.store, &calls)
        .await
        .assert_held("database chaos", 0);
    assert_eq!(
        calls.len(),
        distinct.len(),
        "no attempt's provider called twice"
    );
    assert_eq!(without_call, 0, "no attempt left started or unknown");
}
