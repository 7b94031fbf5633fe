//! The role whole: every pass on a timer of its own. A pass held by a lock
//! holds up no other (the relay goes on publishing); a pass that fails is
//! run again on its timer and recovers; a stop does not wait on a run held
//! past the shutdown grace.

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::fleet::Role;
use sqlx::{Connection, Executor, PgConnection};

use crate::common::database::set_lock_timeout;
use crate::common::{self, TestEnv, config, config_text, new_job, wait_for};

/// A session that holds `attempts` locked against every reader, as a
/// migration's `ALTER TABLE` or an operator's `LOCK TABLE` does.
async fn lock_attempts(env: &TestEnv) -> PgConnection {
    let mut conn = PgConnection::connect(&env.database_url).await.unwrap();
    conn.execute("BEGIN").await.unwrap();
    conn.execute("LOCK TABLE attempts IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    conn
}

/// Waits until a session of the test's database waits for a lock.
async fn a_pass_waits_on_the_lock(env: &TestEnv) {
    wait_for(
        "a pass to wait on the lock",
        Duration::from_secs(20),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(env.store.pool())
            .await
            .unwrap();
            (waiting > 0).then_some(())
        },
    )
    .await;
}

/// Inserts an event row due now, as a settlement whose publisher died leaves it.
async fn event_due(env: &TestEnv, id: &str) {
    sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, not_before)
         VALUES ('onejob.events', 'job.succeeded', $1, '{}', now())",
    )
    .bind(id)
    .execute(env.store.pool())
    .await
    .unwrap();
}

/// The reconciler role running with `settings`, and `attempts` locked
/// under it (with a `lock_timeout` on the database first, if asked) until
/// a pass waits on the lock.
struct Locked {
    env: TestEnv,
    fleet: common::Fleet,
    holder: PgConnection,
    _file: common::tempfile_path::TempConfig,
}

async fn locked(settings: &str, lock_timeout: bool) -> Locked {
    let text = super::worker(&config_text("http://127.0.0.1:9/v1", None, ""), settings);
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    if lock_timeout {
        set_lock_timeout(&env).await;
    }
    let fleet = env.fleet(config.clone(), vec![Role::Reconciler]).await;
    let holder = lock_attempts(&env).await;
    a_pass_waits_on_the_lock(&env).await;
    Locked {
        env,
        fleet,
        holder,
        _file: file,
    }
}

/// `attempts` locked with no timeout: the sweeps that read it wait on the
/// lock, and meanwhile the relay publishes an event that fell due, again
/// and again. Released, the vanished-worker sweep runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pass_held_by_a_lock_holds_up_no_other() {
    let Locked {
        env, fleet, holder, ..
    } = locked("", false).await;
    let amqp = env.amqp().await;
    let (events, queue) = env.watch_events(&amqp).await;
    let runs = &fleet.ctx.pass_runs;
    // Two relay runs later, a sweep that began before the lock has ended;
    // every one begun since waits on it.
    runs.wait(&runs.counts(), &["relay"], 2).await;
    let held = runs.counts();
    for round in 0..3 {
        event_due(&env, &format!("held-{round}")).await;
        let got = common::wait_for_messages(&env, &events, &queue).await;
        assert_eq!(got.len(), 1, "round {round}");
    }
    assert!(runs.count("relay") > held["relay"], "{:?}", runs.counts());
    assert_eq!(
        runs.count("vanished"),
        held.get("vanished").copied().unwrap_or(0),
        "the vanished sweep waits on the lock: {:?}",
        runs.counts()
    );
    drop(holder);
    let released = runs.counts();
    runs.wait(&released, &["vanished", "lost", "kept", "hedge"], 1)
        .await;
    fleet.stop().await;
}

/// With a `lock_timeout` on the database, the sweeps held by the lock fail
/// run after run, and are run again on their timers (they never stop);
/// released, the vanished-worker sweep does its job again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_pass_is_run_again_and_recovers() {
    let Locked {
        env, fleet, holder, ..
    } = locked("vanished_grace = \"100ms\"", true).await;
    let runs = &fleet.ctx.pass_runs;
    let before = runs.counts();
    runs.wait(&before, &["vanished"], 3).await;
    let metrics = onejob::edges::metrics::render();
    assert!(
        metrics.contains("onejob_reconciler_runs_total{pass=\"vanished\",outcome=\"failed\"}"),
        "{metrics}"
    );
    drop(holder);
    let new = new_job("acct_t", "t-1", "vanishes");
    let (job_id, attempt) = (new.job_id, new.attempt_id);
    env.store.admission().admit(&[new]).await.unwrap();
    env.store
        .settle()
        .start("primary", &[attempt], Duration::from_millis(10))
        .await
        .unwrap();
    let job = common::wait_for_status(&env, job_id, JobStatus::Unknown).await;
    assert_eq!(job.attempts[0].status, AttemptStatus::Unknown);
    fleet.stop().await;
}

/// A stop while sweeps wait on a lock held for good: the role stops once
/// `shutdown_grace` is over, leaving the held runs, and nothing it did is
/// lost (the event published before the stop stays published).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stop_leaves_a_run_held_past_the_shutdown_grace() {
    let Locked {
        env, fleet, holder, ..
    } = locked("shutdown_grace = \"1s\"", false).await;
    event_due(&env, "before-the-stop").await;
    common::all_published(&env.store).await;
    // Fleet::stop fails the test if the role has not stopped within 30 s.
    fleet.stop().await;
    drop(holder);
}
