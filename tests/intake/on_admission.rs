//! A worker that runs both intake and a provider's consumer claims and calls
//! a job it has just admitted while a call slot is free, without waiting for
//! the attempt's message to come back from the broker; the message is
//! published all the same, and its delivery is dropped. Every guarantee is
//! the claim's: one call per job, and a worker killed while the call it
//! started this way is at the provider leaves the attempt to the vanished
//! sweep, as any started attempt. Between admission and the claim's commit,
//! a gate the test holds inside the claim's statement gives the chosen
//! instant: a worker killed there, whether its claim then commits or not,
//! makes at most one call (the chaos tests kill workers at random instants
//! of the same path).

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;
use sqlx::{Connection, Executor, PgConnection};

use crate::common::chaos::{Workers, remove_logs};
use crate::common::{self, P, TestEnv, config, config_for, mock, wait_for, wait_for_status};

/// The log filter that shows the attempts started on admission.
const LOG: &str = "warn,onejob::roles::attempts=debug";

/// The statuses of a job's attempts, in number order.
async fn attempt_statuses(env: &TestEnv, job: onejob::domain::JobId) -> Vec<String> {
    sqlx::query_scalar("SELECT status FROM attempts WHERE job_id = $1 ORDER BY number")
        .bind(job.0)
        .fetch_all(env.store.pool())
        .await
        .unwrap()
}

/// One worker process with every role, logging the attempts started on
/// admission; and a producer.
async fn one_worker(env: &TestEnv, config: &std::path::Path) -> (Workers, Producer) {
    let url = env.amqp_url.clone();
    let workers = Workers::start_logging(1, env, config, move |_| url.clone(), LOG);
    (workers, Producer::connect(&env.amqp_url).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_calls_a_job_it_admitted_before_its_message_comes_back() {
    let provider = mock(MockOptions::default()).await;
    let (cfg, file) = config(&config_for(&[P("primary", &provider.base_url(), "")], ""));
    let env = TestEnv::new(&cfg).await;
    let (workers, producer) = one_worker(&env, &file.path).await;
    // One at a time: each finds the worker's call slots free.
    let mut jobs = Vec::new();
    for i in 0..10 {
        let job = common::submit(&producer, "acct_local", &format!("l-{i}"), "text").await;
        wait_for_status(&env, job, JobStatus::Succeeded).await;
        jobs.push(job);
    }
    for job in &jobs {
        assert_eq!(
            attempt_statuses(&env, *job).await,
            ["succeeded"],
            "job {job}"
        );
    }
    assert_eq!(provider.stats.requests(), 10, "one call per job");
    // The messages come back, and their deliveries are dropped.
    let log_file = workers.log_dir.join("worker-0.log");
    let log = wait_for(
        "a delivery to be dropped",
        Duration::from_secs(20),
        || async {
            let log = std::fs::read_to_string(&log_file).unwrap_or_default();
            log.contains("attempt started on admission: its delivery is dropped")
                .then_some(log)
        },
    )
    .await;
    assert!(
        log.matches("attempt started on admission").count() >= 2,
        "no attempt was started on admission:\n{log}"
    );
    producer.close().await;
    remove_logs(&workers.stop());
    assert_eq!(
        provider.stats.requests(),
        10,
        "a dropped delivery made no call"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_during_a_call_it_started_on_admission_leaves_it_unknown() {
    let provider = mock(MockOptions {
        delay: Duration::from_secs(4),
        ..MockOptions::default()
    })
    .await;
    let (cfg, file) = config(&config_for(&[P("primary", &provider.base_url(), "")], ""));
    let env = TestEnv::new(&cfg).await;
    let (mut workers, producer) = one_worker(&env, &file.path).await;
    let job = common::submit(&producer, "acct_kill", "k-0", "text").await;
    // The call is at the provider: the chosen instant.
    wait_for(
        "the call to reach the provider",
        Duration::from_secs(20),
        || async { (provider.stats.requests() == 1).then_some(()) },
    )
    .await;
    let log_dir = workers.log_dir.clone();
    let log = std::fs::read_to_string(log_dir.join("worker-0.log")).unwrap();
    assert!(
        log.contains("attempt started on admission"),
        "the call was not started on admission:\n{log}"
    );
    workers.kill_one(0);
    // The restarted worker finds the attempt started with no worker: unknown,
    // and the job blocked until it is resolved. Nothing else starts.
    common::wait_for_attempt(&env, job, AttemptStatus::Unknown).await;
    wait_for_status(&env, job, JobStatus::Unknown).await;
    assert_eq!(attempt_statuses(&env, job).await, ["unknown"]);
    assert_eq!(
        provider.stats.requests(),
        1,
        "no second call while the first is unknown"
    );
    producer.close().await;
    let logs = workers.stop();
    remove_logs(&logs);
}

/// A lock the test holds that every claim of a queued attempt waits for
/// inside its statement (a trigger on `attempts` of this test's database):
/// the chosen instant after admission has committed and before the claim
/// has.
struct ClaimGate(PgConnection);

/// The advisory lock of the gate.
const GATE: i64 = 4141;

impl ClaimGate {
    async fn close(env: &TestEnv) -> ClaimGate {
        let mut conn = PgConnection::connect(&env.database_url).await.unwrap();
        conn.execute(
            "CREATE FUNCTION test_claim_gate() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_advisory_xact_lock(4141); RETURN NEW; END $$",
        )
        .await
        .unwrap();
        conn.execute(
            "CREATE TRIGGER test_claim_gate BEFORE UPDATE ON attempts FOR EACH ROW
             WHEN (OLD.status = 'queued' AND NEW.status = 'started')
             EXECUTE FUNCTION test_claim_gate()",
        )
        .await
        .unwrap();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(GATE)
            .execute(&mut conn)
            .await
            .unwrap();
        ClaimGate(conn)
    }

    /// The server process of the first claim that waits at the gate.
    async fn waiting(env: &TestEnv) -> i32 {
        wait_for(
            "a claim to wait at the gate",
            Duration::from_secs(20),
            || async {
                sqlx::query_scalar(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
                       AND objid = $1 AND database =
                         (SELECT oid FROM pg_database WHERE datname = current_database())",
                )
                .bind(GATE)
                .fetch_optional(env.store.pool())
                .await
                .unwrap()
            },
        )
        .await
    }

    async fn open(mut self) {
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(GATE)
            .execute(&mut self.0)
            .await
            .unwrap();
        self.0.close().await.ok();
    }
}

/// A lone job admitted by a worker whose claim on admission waits at the
/// gate, when that worker is killed; `commit` says whether the claim's
/// statement then goes on to commit (the server ran it, the reply was lost
/// with the worker) or dies with its connection. Returns the job and the
/// restarted workers.
async fn killed_before_the_claim_commits(
    env: &TestEnv,
    config: &std::path::Path,
    commit: bool,
) -> (onejob::domain::JobId, Workers, Producer) {
    let gate = ClaimGate::close(env).await;
    let (mut workers, producer) = one_worker(env, config).await;
    let job = common::submit(&producer, "acct_gate", "g-0", "text").await;
    let claim = ClaimGate::waiting(env).await;
    let log = std::fs::read_to_string(workers.log_dir.join("worker-0.log")).unwrap();
    assert!(
        log.contains("attempt taken on admission"),
        "the waiting claim is not the one on admission:\n{log}"
    );
    workers.kill_one(0);
    if !commit {
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(claim)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
        assert!(ended, "the claim's server process was not ended");
        wait_for(
            "the claim's connection to end",
            Duration::from_secs(20),
            || async {
                let alive: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
                )
                .bind(claim)
                .fetch_one(env.store.pool())
                .await
                .unwrap();
                (!alive).then_some(())
            },
        )
        .await;
    }
    gate.open().await;
    (job, workers, producer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_before_its_claim_on_admission_commits_leaves_the_job_to_its_message() {
    let provider = mock(MockOptions::default()).await;
    let (cfg, file) = config(&config_for(&[P("primary", &provider.base_url(), "")], ""));
    let env = TestEnv::new(&cfg).await;
    let (job, workers, producer) = killed_before_the_claim_commits(&env, &file.path, false).await;
    // The admission stands; the claim never took effect; the attempt's
    // message (published from the outbox) is claimed by the restarted worker.
    wait_for_status(&env, job, JobStatus::Succeeded).await;
    assert_eq!(attempt_statuses(&env, job).await, ["succeeded"]);
    assert_eq!(provider.stats.requests(), 1, "one call for the job");
    producer.close().await;
    remove_logs(&workers.stop());
    assert_eq!(provider.stats.requests(), 1, "and no other afterwards");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_on_admission_that_commits_after_its_worker_died_makes_no_call() {
    let provider = mock(MockOptions::default()).await;
    let (cfg, file) = config(&config_for(&[P("primary", &provider.base_url(), "")], ""));
    let env = TestEnv::new(&cfg).await;
    let (job, workers, producer) = killed_before_the_claim_commits(&env, &file.path, true).await;
    // The attempt is `started` under the dead worker's claim; the restarted
    // worker's delivery finds it another's and calls nothing.
    wait_for_status(&env, job, JobStatus::Unknown).await;
    assert_eq!(attempt_statuses(&env, job).await, ["unknown"]);
    producer.close().await;
    remove_logs(&workers.stop());
    assert_eq!(
        provider.stats.requests(),
        0,
        "the dead worker's claim made no call, and none was made twice"
    );
}
