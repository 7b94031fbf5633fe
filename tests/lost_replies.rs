//! A reply lost after Postgres ran a statement (the connection dropped between
//! the server's commit and the client hearing of it) is found out, not
//! guessed: a claim finds its own attempts, a worker starts, an operator's
//! action is reported done; and a session that stops talking frees its rows.

use onejob_test_support as common;

use std::sync::Arc;
use std::time::Duration;

use common::database::{DropDatabase, attempt_status, give_up, started, success};
use common::{P, TestEnv, config, config_for, mock, new_job, store_env, submit, wait_for};
use futures_util::future::join_all;
use onejob::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use onejob::edges::store::{Actor, Finished, Store, Verdict};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_run_again_after_a_lost_reply_finds_its_own_attempts() {
    let env = store_env().await;
    let news: Vec<_> = (0..3)
        .map(|i| new_job("acct_db", &format!("lost-{i}"), "text"))
        .collect();
    let attempts: Vec<_> = news.iter().map(|n| n.attempt_id).collect();
    env.store.admission().admit(&news).await.unwrap();
    let token = uuid::Uuid::now_v7();
    let first = env
        .store
        .settle()
        .claim("primary", "none", &attempts, Duration::from_secs(30), token)
        .await
        .unwrap();
    assert_eq!(first.started.len(), 3);
    // The reply was lost: the same claim runs again and finds them its own.
    let again = env
        .store
        .settle()
        .claim("primary", "none", &attempts, Duration::from_secs(30), token)
        .await
        .unwrap();
    let mut ids: Vec<_> = again.started.iter().map(|s| s.attempt_id).collect();
    ids.sort();
    let mut want = attempts.clone();
    want.sort();
    assert_eq!(ids, want);
    // Another claim (a redelivery to another worker) does not.
    let other = env
        .store
        .settle()
        .claim(
            "primary",
            "none",
            &attempts,
            Duration::from_secs(30),
            uuid::Uuid::now_v7(),
        )
        .await
        .unwrap();
    assert!(other.started.is_empty() && other.busy.is_empty());
    one_attempt_is_handed_back_under_its_own_claim(&env, attempts[0], token).await;
    // A claim given up is handed back: queued again, for its redelivery.
    assert_eq!(env.store.settle().unclaim(token).await.unwrap(), 3);
    for new in &news {
        assert_eq!(
            attempt_status(&env.store, new.job_id).await,
            AttemptStatus::Queued
        );
    }
    let retaken = env
        .store
        .settle()
        .claim(
            "primary",
            "none",
            &attempts,
            Duration::from_secs(30),
            uuid::Uuid::now_v7(),
        )
        .await
        .unwrap();
    assert_eq!(retaken.started.len(), 3);
}

/// A claim whose commit took effect unseen, run again while another session
/// holds its job's row, still finds its attempt its own: it needs no lock on
/// a job it has already started. (Answered "busy" instead, the consumer
/// claimed it again under a new claim, which took it for another worker's and
/// dropped it: started with no call, until the vanished sweep made it
/// `unknown`, as the database chaos test once saw.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_run_again_finds_its_own_attempt_while_its_job_row_is_held() {
    use sqlx::{Connection, Executor};
    let env = store_env().await;
    let new = new_job("acct_db", "lost-held", "text");
    env.store
        .admission()
        .admit(std::slice::from_ref(&new))
        .await
        .unwrap();
    let attempts = [new.attempt_id];
    let token = uuid::Uuid::now_v7();
    let first = env
        .store
        .settle()
        .claim("primary", "none", &attempts, Duration::from_secs(30), token)
        .await
        .unwrap();
    assert_eq!(first.started.len(), 1);
    // The reply was lost, and another session holds the job's row meanwhile.
    let mut holder = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    holder.execute("BEGIN").await.unwrap();
    sqlx::query("SELECT 1 FROM jobs WHERE id = $1 FOR UPDATE")
        .bind(new.job_id.0)
        .execute(&mut holder)
        .await
        .unwrap();
    let again = tokio::time::timeout(
        Duration::from_secs(10),
        env.store
            .settle()
            .claim("primary", "none", &attempts, Duration::from_secs(30), token),
    )
    .await
    .expect("the claim does not wait for the held row")
    .unwrap();
    let ids: Vec<_> = again.started.iter().map(|s| s.attempt_id).collect();
    assert_eq!(ids, vec![new.attempt_id], "busy: {:?}", again.busy);
    assert!(again.busy.is_empty());
    assert_eq!(again.started[0].version, first.started[0].version);
    assert_eq!(again.started[0].input, first.started[0].input);
    holder.execute("ROLLBACK").await.unwrap();
}

/// Replies lost after Postgres ran a statement (a connection reset between
/// the server's commit and the client hearing of it), through the whole fleet:
/// every intent ends as one succeeded job, every attempt's provider was called
/// exactly once, and no attempt is left `started` or `unknown` without a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replies_lost_after_commits_leave_no_attempt_without_its_call() {
    const JOBS: usize = 200;
    let primary = mock(MockOptions {
        delay: Duration::from_millis(20),
        jitter: Duration::from_millis(30),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&config_for(
        &[P("primary", &primary.base_url(), "timeout = \"20s\"")],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let server = common::database::pg_server();
    // One committed reply in 8 is lost, 50 in all.
    let lossy = common::lossy::LossyPostgres::to(&server, 8, 50).await;
    let ctx = onejob::shared::runtime::Context::connect(
        config.clone(),
        &lossy.url(&env.name),
        &env.amqp_url,
    )
    .await
    .expect("worker context through the lossy path");
    let shutdown = onejob::edges::shutdown::Shutdown::new();
    let fleet = tokio::spawn(onejob::fleet::run(ctx, vec![], shutdown.clone()));
    lossy.start_losing();
    let producer = Arc::new(Producer::connect(&env.amqp_url).await.unwrap());

    let jobs: Vec<JobId> = join_all((0..JOBS).map(|i| {
        let producer = producer.clone();
        async move { submit(&producer, "acct_lossy", &format!("lossy-{i}"), "lossy").await }
    }))
    .await;
    let distinct: std::collections::BTreeSet<_> = jobs.iter().collect();
    assert_eq!(distinct.len(), JOBS, "one job per intent");

    wait_for("every job to succeed", Duration::from_secs(90), || async {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE status = 'succeeded'")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
        (done == JOBS as i64).then_some(())
    })
    .await;
    let lost = lossy.lost();
    lossy.stop_losing();
    assert!(lost >= 10, "the fault happened: {lost} replies lost");

    let attempts: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT id, status FROM attempts ORDER BY id")
            .fetch_all(env.store.pool())
            .await
            .unwrap();
    assert_eq!(attempts.len(), JOBS, "one attempt per job: {attempts:?}");
    assert!(
        attempts.iter().all(|(_, s)| s == "succeeded"),
        "every attempt succeeded: {attempts:?}"
    );
    let mut calls = primary.stats.idempotency_keys();
    calls.sort();
    let mut want: Vec<String> = attempts.iter().map(|(id, _)| id.to_string()).collect();
    want.sort();
    assert_eq!(calls, want, "each attempt's provider called exactly once");
    eprintln!(
        "lossy Postgres: {JOBS} jobs, {lost} replies lost after commits, 0 lost, 0 duplicate calls, 0 unknown"
    );

    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(30), fleet)
        .await
        .expect("fleet stops")
        .expect("fleet task")
        .expect("fleet ran without errors");
}

/// A worker that starts while replies are being lost (its migrations' among
/// them) waits them out and starts; it never stops half-started.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_starts_through_replies_lost_at_its_start() {
    let (config, _file) = config(&common::config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let server = common::database::pg_server();
    // A fresh database: the worker creates and migrates it through the fault.
    let name = format!("{}_lossy", env.name);
    let _dropped = DropDatabase(name.clone());
    let lossy = common::lossy::LossyPostgres::to(&server, 2, 8).await;
    lossy.start_losing();
    let ctx =
        onejob::shared::runtime::Context::connect(config.clone(), &lossy.url(&name), &env.amqp_url)
            .await;
    let lost = lossy.lost();
    let ctx = ctx.expect("the worker starts through lost replies");
    assert!(
        lost >= 4,
        "the fault happened at start: {lost} replies lost"
    );
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(ctx.store.pool())
        .await
        .unwrap();
    assert_eq!(
        applied,
        onejob::edges::store::MIGRATOR.iter().count() as i64
    );
    ctx.store.close().await;
}

/// An operator's resolve or cancel whose commit reply was lost is reported
/// done (its audit row says it committed), not "it changed meanwhile"; and it
/// is done once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_action_whose_commit_reply_was_lost_is_reported_done() {
    let env = store_env().await;
    let jobs = started(&env.store, "op", 2).await;
    let unknown = Finished {
        verdict: Verdict::Unknown {
            error: "outcome_unknown: timed out".into(),
        },
        ..success(&jobs[0])
    };
    env.store
        .settle()
        .finalize(&[unknown], &give_up)
        .await
        .unwrap();
    let server = common::database::pg_server();
    let lossy = common::lossy::LossyPostgres::to(&server, 1, 0).await;
    let store = store_through(&lossy, &env).await;
    let actor = Actor::cli(Some("lost reply"));

    lossy.lose_next_commit();
    let resolved = store
        .settle()
        .resolve(
            jobs[0].attempt_id,
            onejob::edges::store::Resolution::Failed,
            &give_up,
            &actor,
        )
        .await
        .unwrap();
    assert_eq!(lossy.lost(), 1, "the commit's reply was lost");
    assert!(resolved.is_ok(), "reported done: {resolved:?}");
    assert_eq!(
        attempt_status(&env.store, jobs[0].job_id).await,
        AttemptStatus::Failed
    );

    lossy.lose_next_commit();
    let cancelled = store.jobs().cancel(jobs[1].job_id, &actor).await.unwrap();
    assert_eq!(lossy.lost(), 2, "the commit's reply was lost");
    assert!(cancelled.is_ok(), "reported done: {cancelled:?}");
    let job = env.store.jobs().job(jobs[1].job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);

    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM audit WHERE reason = 'lost reply'")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 2, "each action recorded once");
}

/// Every session onejob opens ends an idle transaction and probes a silent
/// peer, so a half-open connection cannot hold job rows forever; a setting the
/// URL names itself is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sessions_end_idle_transactions_and_probe_silent_peers() {
    let env = store_env().await;
    let (config, _file) = config(&common::config_text("http://127.0.0.1:9/v1", None, ""));
    let show = |store: Store| async move {
        let mut out = Vec::new();
        for setting in [
            "idle_in_transaction_session_timeout",
            "tcp_keepalives_idle",
            "tcp_keepalives_interval",
            "tcp_keepalives_count",
        ] {
            let value: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
                .fetch_one(store.pool())
                .await
                .unwrap();
            out.push(value);
        }
        out
    };
    let routes = onejob::shared::runtime::routes(&config);
    let store = Store::connect(&env.database_url, 2, routes.clone(), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(show(store).await, ["1min", "30", "10", "3"]);
    let url = format!(
        "{}?options=-c%20idle_in_transaction_session_timeout%3D5s",
        env.database_url
    );
    let store = Store::connect(&url, 2, routes, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(show(store).await, ["5s", "30", "10", "3"]);
}

/// One attempt whose handler was cut off is handed back alone, and only
/// under its own claim; queued again, it is claimed again.
async fn one_attempt_is_handed_back_under_its_own_claim(
    env: &TestEnv,
    attempt: AttemptId,
    token: uuid::Uuid,
) {
    let other_token = uuid::Uuid::now_v7();
    assert!(
        !env.store
            .settle()
            .unclaim_attempt(attempt, other_token)
            .await
            .unwrap()
    );
    assert!(
        env.store
            .settle()
            .unclaim_attempt(attempt, token)
            .await
            .unwrap()
    );
    assert!(
        !env.store
            .settle()
            .unclaim_attempt(attempt, token)
            .await
            .unwrap()
    );
    let retaken = env
        .store
        .settle()
        .claim(
            "primary",
            "none",
            &[attempt],
            Duration::from_secs(30),
            token,
        )
        .await
        .unwrap();
    assert_eq!(retaken.started.len(), 1, "queued again, claimed again");
}

/// The evidence pass's take of an unknown whose commit reply was lost: its
/// next try finds its own lease (a token per take) and looks, where it used
/// to find the unknown leased, by itself, and leave it for a whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_look_whose_take_reply_was_lost_finds_its_own_lease() {
    let env = store_env().await;
    let s = started(&env.store, "look", 1).await.remove(0);
    let unknown = Finished {
        verdict: Verdict::Unknown {
            error: "outcome_unknown: timed out".into(),
        },
        ..success(&s)
    };
    env.store
        .settle()
        .finalize(&[unknown], &give_up)
        .await
        .unwrap();
    sqlx::query("UPDATE attempts SET deadline_at = now() - interval '1 minute' WHERE id = $1")
        .bind(s.attempt_id.0)
        .execute(env.store.pool())
        .await
        .unwrap();
    let server = common::database::pg_server();
    let lossy = common::lossy::LossyPostgres::to(&server, 1, 1).await;
    let store = store_through(&lossy, &env).await;
    lossy.start_losing();
    let due = store
        .evidence()
        .evidence_due(
            &[("primary".into(), Duration::ZERO)],
            Duration::from_secs(60),
            1,
        )
        .await
        .unwrap();
    assert_eq!(lossy.lost(), 1, "the take's reply was lost");
    assert_eq!(due.len(), 1, "taken all the same");
    assert_eq!(due[0].attempt_id, s.attempt_id);
    assert_eq!(due[0].looks, 1, "one look, counted once");
}

/// A store of `env`'s database reached through `lossy`.
async fn store_through(lossy: &common::lossy::LossyPostgres, env: &TestEnv) -> Store {
    let (config, _file) = config(&common::config_text("http://127.0.0.1:9/v1", None, ""));
    Store::connect(
        &lossy.url(&env.name),
        2,
        onejob::shared::runtime::routes(&config),
        Duration::from_secs(5),
    )
    .await
    .unwrap()
}
