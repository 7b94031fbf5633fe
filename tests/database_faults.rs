//! The database's everyday behaviour never costs a paid answer: a row held
//! under someone else's lock (an operator's open transaction, a migration, a
//! long report) costs only the settlement that needs it a later try, never its
//! neighbours nor the answer; a claim whose reply was lost is found again by
//! its own token; and a job whose calls are still in flight is never pruned.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{P, TestEnv, config, config_for, mock, new_job, store_env, submit, wait_for};
use futures_util::future::join_all;
use onejob::domain::{AttemptStatus, JobId, JobStatus};
use onejob::mock::MockOptions;
use onejob::store::{Actor, Admission, Finished, Settled, Started, Store, Verdict};
use onejob_producer::Producer;
use serde_json::json;
use sqlx::{Connection, Executor, PgConnection};

/// A session like an operator's `psql` that holds one job row `FOR UPDATE`
/// until it is dropped or [`Holder::release`]d.
struct Holder(PgConnection);

impl Holder {
    async fn hold(url: &str, job: JobId) -> Holder {
        let mut conn = PgConnection::connect(url).await.expect("holder connects");
        conn.execute("BEGIN").await.expect("begin");
        sqlx::query("SELECT id FROM jobs WHERE id = $1 FOR UPDATE")
            .bind(job.0)
            .fetch_one(&mut conn)
            .await
            .expect("lock the job row");
        Holder(conn)
    }

    async fn release(mut self) {
        self.0.execute("ROLLBACK").await.expect("release");
        self.0.close().await.ok();
    }
}

/// Admits `n` jobs and starts their first attempts.
async fn started(store: &Store, prefix: &str, n: usize) -> Vec<Started> {
    let news: Vec<_> = (0..n)
        .map(|i| new_job("acct_db", &format!("{prefix}-{i}"), "text"))
        .collect();
    let attempts: Vec<_> = news.iter().map(|n| n.attempt_id).collect();
    for admitted in store.admit(&news).await.unwrap() {
        assert!(matches!(admitted, Admission::Created { .. }));
    }
    let started = store
        .start("primary", &attempts, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(started.len(), n);
    started
}

fn success(s: &Started) -> Finished {
    Finished {
        attempt_id: s.attempt_id,
        job_id: s.job_id,
        version: s.version,
        provider_request_id: Some(format!("req-{}", s.attempt_id)),
        usage: Some(json!({"total_tokens": 10})),
        verdict: Verdict::Succeeded(json!({ "summary": s.attempt_id.to_string() })),
    }
}

fn give_up(f: &onejob::store::FailedJob) -> onejob::store::NextStep {
    common::give_up(f)
}

/// Sets a `lock_timeout` on the test's database, as a production role or
/// database often has, and connects a store whose sessions have it.
async fn with_lock_timeout(env: &TestEnv) -> Store {
    env.store
        .pool()
        .execute(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} SET lock_timeout = '300ms'",
            env.name
        )))
        .await
        .unwrap();
    let (config, _file) = config(&common::config_text("http://127.0.0.1:9/v1", None, ""));
    Store::connect(
        &env.database_url,
        4,
        onejob::runtime::routes(&config),
        Duration::from_secs(5),
    )
    .await
    .unwrap()
}

/// Fails the test, instead of hanging it, when `f` waits for a lock.
async fn soon<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} waited for a held row"))
}

async fn attempt_status(store: &Store, job: JobId) -> AttemptStatus {
    store.job(job).await.unwrap().unwrap().attempts[0].status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_job_row_makes_only_its_own_settlement_wait_under_a_lock_timeout() {
    let env = store_env().await;
    let store = with_lock_timeout(&env).await;
    let jobs = started(&store, "held", 12).await;
    let held = Holder::hold(&env.database_url, jobs[3].job_id).await;

    // Every kind of settlement in one flush, one of them on the held job.
    let mut finished: Vec<Finished> = jobs.iter().map(success).collect();
    finished[5].verdict = Verdict::Failed {
        error: "provider_error: HTTP 500".into(),
        retryable: true,
        retry_after: None,
    };
    finished[7].verdict = Verdict::Unknown {
        error: "outcome_unknown: timed out".into(),
    };
    let (settled, _) = store.finalize(&finished, &give_up).await.unwrap();
    for (i, s) in settled.iter().enumerate() {
        let want = match i {
            3 => Settled::Busy,
            5 => Settled::Failed {
                next: None,
                job_failed: true,
            },
            7 => Settled::Unknown,
            _ => Settled::Won,
        };
        assert_eq!(s, &want, "settlement {i}");
    }
    // Nothing of the held one was written; it is still open, its answer unspent.
    assert_eq!(
        attempt_status(&store, jobs[3].job_id).await,
        AttemptStatus::Started
    );
    // Still held: asked again, it waits again, and never becomes anything else.
    let (again, _) = store
        .finalize(std::slice::from_ref(&finished[3]), &give_up)
        .await
        .unwrap();
    assert_eq!(again, vec![Settled::Busy]);

    held.release().await;
    let (after, _) = store
        .finalize(std::slice::from_ref(&finished[3]), &give_up)
        .await
        .unwrap();
    assert_eq!(after, vec![Settled::Won]);
    let job = store.job(jobs[3].job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Succeeded);
    assert_eq!(job.completed_by, Some(jobs[3].attempt_id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_job_row_makes_only_its_own_claim_wait_and_the_sweeps_go_on() {
    let env = store_env().await;
    let news: Vec<_> = (0..4)
        .map(|i| new_job("acct_db", &format!("claim-{i}"), "text"))
        .collect();
    let attempts: Vec<_> = news.iter().map(|n| n.attempt_id).collect();
    let held_job = news[1].job_id;
    env.store.admit(&news).await.unwrap();
    let held = Holder::hold(&env.database_url, held_job).await;

    let token = uuid::Uuid::now_v7();
    let claim = soon(
        "the claim",
        env.store
            .claim("primary", &attempts, Duration::from_secs(30), token),
    )
    .await
    .unwrap();
    assert_eq!(claim.busy, vec![attempts[1]]);
    let mut started: Vec<_> = claim.started.iter().map(|s| s.attempt_id).collect();
    started.sort();
    let mut want = vec![attempts[0], attempts[2], attempts[3]];
    want.sort();
    assert_eq!(started, want);
    assert_eq!(
        attempt_status(&env.store, held_job).await,
        AttemptStatus::Queued
    );

    // The vanished sweep skips a held job and still marks the others.
    sqlx::query(
        "UPDATE attempts SET deadline_at = now() - interval '1 hour' WHERE status = 'started'",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    held.release().await;
    let held = Holder::hold(&env.database_url, news[0].job_id).await;
    let marked = soon(
        "the vanished sweep",
        env.store.expire_vanished(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    assert_eq!(marked.len(), 2, "the two attempts whose jobs are free");
    assert!(!marked.contains(&attempts[0]));
    held.release().await;

    // Released, the held claim goes through.
    let claim = env
        .store
        .claim("primary", &[attempts[1]], Duration::from_secs(30), token)
        .await
        .unwrap();
    assert_eq!(claim.started.len(), 1);
    assert!(claim.busy.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_run_again_after_a_lost_reply_finds_its_own_attempts() {
    let env = store_env().await;
    let news: Vec<_> = (0..3)
        .map(|i| new_job("acct_db", &format!("lost-{i}"), "text"))
        .collect();
    let attempts: Vec<_> = news.iter().map(|n| n.attempt_id).collect();
    env.store.admit(&news).await.unwrap();
    let token = uuid::Uuid::now_v7();
    let first = env
        .store
        .claim("primary", &attempts, Duration::from_secs(30), token)
        .await
        .unwrap();
    assert_eq!(first.started.len(), 3);
    // The reply was lost: the same claim runs again and finds them its own.
    let again = env
        .store
        .claim("primary", &attempts, Duration::from_secs(30), token)
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
        .claim(
            "primary",
            &attempts,
            Duration::from_secs(30),
            uuid::Uuid::now_v7(),
        )
        .await
        .unwrap();
    assert!(other.started.is_empty() && other.busy.is_empty());
    // A claim given up is handed back: queued again, for its redelivery.
    assert_eq!(env.store.unclaim(token).await.unwrap(), 3);
    for new in &news {
        assert_eq!(
            attempt_status(&env.store, new.job_id).await,
            AttemptStatus::Queued
        );
    }
    let retaken = env
        .store
        .claim(
            "primary",
            &attempts,
            Duration::from_secs(30),
            uuid::Uuid::now_v7(),
        )
        .await
        .unwrap();
    assert_eq!(retaken.started.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_job_whose_calls_are_in_flight_is_not_pruned() {
    let env = store_env().await;
    let jobs = started(&env.store, "prune", 2).await;
    let (busy, idle) = (&jobs[0], &jobs[1]);
    for s in [busy, idle] {
        env.store
            .cancel_job(s.job_id, &Actor::cli(Some("test")))
            .await
            .unwrap()
            .unwrap();
    }
    // The idle job's call has ended; the busy job's is still in flight.
    let (settled, _) = env
        .store
        .finalize(&[success(idle)], &give_up)
        .await
        .unwrap();
    assert!(matches!(settled[0], Settled::Discarded { .. }));
    // Ended an hour ago (the guard that keeps ended jobs unchanged is off for it).
    let mut tx = env.store.pool().begin().await.unwrap();
    tx.execute("SET LOCAL session_replication_role = replica")
        .await
        .unwrap();
    tx.execute("UPDATE jobs SET updated_at = now() - interval '1 hour'")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    sqlx::query("UPDATE outbox SET published_at = now()")
        .execute(env.store.pool())
        .await
        .unwrap();
    let policy = onejob::store::Policy::uniform(onejob::config::Retention {
        succeeded: Duration::from_secs(1),
        failed: Duration::from_secs(1),
        cancelled: Duration::from_secs(1),
    });
    let pass = env.store.prune_jobs(&policy, 100, false).await.unwrap();
    assert_eq!(
        pass.pruned.jobs, 1,
        "only the job whose calls have all ended"
    );
    assert!(env.store.job(idle.job_id).await.unwrap().is_none());
    // Its answer arrives a moment later: it is discarded, its spend kept.
    let (settled, _) = env
        .store
        .finalize(&[success(busy)], &give_up)
        .await
        .unwrap();
    assert!(
        matches!(settled[0], Settled::Discarded { .. }),
        "{settled:?}"
    );
    let job = env.store.job(busy.job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded);
    assert_eq!(job.attempts[0].usage, Some(json!({"total_tokens": 10})));
    // Now every call has ended, it may go.
    let pass = env.store.prune_jobs(&policy, 100, false).await.unwrap();
    assert_eq!(pass.pruned.jobs, 1);
}

/// Through the whole fleet, as the fault was met: with a `lock_timeout` on the
/// database, job rows are held while their answers and their neighbours'
/// arrive. The neighbours all succeed while the rows are held; the held jobs'
/// answers are kept, never turned `unknown`; released, the jobs succeed with
/// those answers, and the provider was called once per job.
///
/// Three rows of the first wave of calls (the provider's eight slots) are
/// held: answers that arrive together are settled together, so at least two
/// of them meet their lock in a flush with neighbours.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_job_rows_under_a_lock_timeout_lose_no_answer_and_hold_up_no_neighbour() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(800),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&config_for(
        &[P("primary", &primary.base_url(), "timeout = \"20s\"")],
        "",
    ));
    let env = TestEnv::new(&config).await;
    env.store
        .pool()
        .execute(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} SET lock_timeout = '300ms'",
            env.name
        )))
        .await
        .unwrap();
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Arc::new(Producer::connect(&env.amqp_url).await.unwrap());

    let submitting = tokio::spawn(join_all((0..30).map(move |i| {
        let producer = producer.clone();
        async move { submit(&producer, "acct_db", &format!("held-{i}"), "held").await }
    })));
    let first_wave = wait_for(
        "the first wave of calls",
        Duration::from_secs(20),
        || async {
            let started: Vec<(uuid::Uuid, uuid::Uuid)> = sqlx::query_as(
                "SELECT job_id, id FROM attempts WHERE status = 'started' ORDER BY id",
            )
            .fetch_all(env.store.pool())
            .await
            .unwrap();
            (started.len() >= 8).then_some(started)
        },
    )
    .await;
    let mut holders = Vec::new();
    let mut held = Vec::new();
    for (job, attempt) in first_wave.into_iter().step_by(3).take(3) {
        holders.push(Holder::hold(&env.database_url, JobId(job)).await);
        held.push((JobId(job), onejob::domain::AttemptId(attempt)));
    }
    let others: Vec<JobId> = submitting
        .await
        .unwrap()
        .into_iter()
        .filter(|j| held.iter().all(|(h, _)| h != j))
        .collect();
    assert_eq!(others.len(), 27);

    // While the rows are held: every neighbour succeeds, and the held jobs'
    // answers, arrived, are kept on their attempts, which stay open.
    wait_for(
        "the 27 neighbours to succeed while the rows are held",
        Duration::from_secs(20),
        || async {
            for job in &others {
                if env.store.job(*job).await.unwrap()?.status != JobStatus::Succeeded {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    for (job, attempt) in &held {
        wait_for(
            "a held job's answer to be kept",
            Duration::from_secs(20),
            || async {
                let kept: Option<bool> =
                    sqlx::query_scalar("SELECT answer IS NOT NULL FROM attempts WHERE id = $1")
                        .bind(attempt.0)
                        .fetch_one(env.store.pool())
                        .await
                        .ok();
                (kept == Some(true)).then_some(())
            },
        )
        .await;
        assert_eq!(
            attempt_status(&env.store, *job).await,
            AttemptStatus::Started,
            "an answer received is never turned unknown while its row is held"
        );
    }

    for holder in holders {
        holder.release().await;
    }
    for (job, attempt) in &held {
        let job = common::wait_for_status(&env, *job, JobStatus::Succeeded).await;
        assert_eq!(job.completed_by, Some(*attempt));
        assert_eq!(job.attempts.len(), 1);
        assert_eq!(
            job.result.as_ref().and_then(|r| r["summary"].as_str()),
            Some("mock answer: Summarize: held")
        );
    }
    assert_eq!(
        primary.stats.requests(),
        30,
        "one call per job, none repeated"
    );
    fleet.stop().await;
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
    let pg = common::pg_base();
    let server = pg
        .rsplit('@')
        .next()
        .expect("a host in the Postgres URL")
        .to_owned();
    // One committed reply in 8 is lost, 50 in all.
    let lossy = common::lossy::LossyPostgres::to(&server, 8, 50).await;
    let ctx =
        onejob::runtime::Context::connect(config.clone(), &lossy.url(&env.name), &env.amqp_url)
            .await
            .expect("worker context through the lossy path");
    let shutdown = onejob::shutdown::Shutdown::new();
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
    let admin = common::pg_base();
    let server = admin.rsplit('@').next().expect("a host").to_owned();
    // A fresh database: the worker creates and migrates it through the fault.
    let name = format!("{}_lossy", env.name);
    let _dropped = DropDatabase(name.clone());
    let lossy = common::lossy::LossyPostgres::to(&server, 2, 8).await;
    lossy.start_losing();
    let ctx =
        onejob::runtime::Context::connect(config.clone(), &lossy.url(&name), &env.amqp_url).await;
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
    assert_eq!(applied, onejob::store::MIGRATOR.iter().count() as i64);
    ctx.store.pool().close().await;
}

/// Drops a database the test made, however the test ends.
struct DropDatabase(String);

impl Drop for DropDatabase {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args([
                &format!("{}/postgres", common::pg_base()),
                "-q",
                "-c",
                &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.0),
            ])
            .output();
    }
}

/// A worker that stops while an answer's job row is held keeps the answer on
/// its attempt; once the row is free, the reconciler settles it: the job
/// succeeds with that answer, the provider called once, nothing `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_whose_row_is_held_when_its_worker_stops_is_settled_later() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(300),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&config_for(
        &[P("primary", &primary.base_url(), "timeout = \"2s\"")],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job = submit(&producer, "acct_db", "kept-1", "kept").await;
    let attempt = wait_for("the attempt to start", Duration::from_secs(20), || async {
        let view = env.store.job(job).await.unwrap()?;
        (view.attempts[0].status == AttemptStatus::Started).then_some(view.attempts[0].id)
    })
    .await;
    let held = Holder::hold(&env.database_url, job).await;
    wait_for("the answer to be kept", Duration::from_secs(20), || async {
        let kept: Option<bool> =
            sqlx::query_scalar("SELECT answer IS NOT NULL FROM attempts WHERE id = $1")
                .bind(attempt.0)
                .fetch_one(env.store.pool())
                .await
                .ok();
        (kept == Some(true)).then_some(())
    })
    .await;
    // The worker stops while the row is held; the delivery goes back.
    fleet.stop().await;
    // Past its deadline and the grace, where the vanished sweep would make a
    // started attempt without an answer `unknown`.
    wait_for(
        "the attempt's deadline and grace to pass",
        Duration::from_secs(20),
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT deadline_at + interval '1 second' < now() FROM attempts WHERE id = $1",
            )
            .bind(attempt.0)
            .fetch_one(env.store.pool())
            .await
            .unwrap()
            .then_some(())
        },
    )
    .await;
    held.release().await;

    let fleet = env.fleet(config.clone(), vec![]).await;
    let view = common::wait_for_status(&env, job, JobStatus::Succeeded).await;
    assert_eq!(view.completed_by, Some(attempt));
    assert_eq!(
        view.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: kept")
    );
    assert_eq!(view.attempts.len(), 1);
    assert_eq!(
        primary.stats.requests(),
        1,
        "the answer was not bought twice"
    );
    fleet.stop().await;
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
    let routes = onejob::runtime::routes(&config);
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
    env.store.finalize(&[unknown], &give_up).await.unwrap();
    let server = common::pg_base()
        .rsplit('@')
        .next()
        .expect("a host")
        .to_owned();
    let lossy = common::lossy::LossyPostgres::to(&server, 1, 0).await;
    let (config, _file) = config(&common::config_text("http://127.0.0.1:9/v1", None, ""));
    let store = Store::connect(
        &lossy.url(&env.name),
        2,
        onejob::runtime::routes(&config),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let actor = Actor::cli(Some("lost reply"));

    lossy.lose_next_commit();
    let resolved = store
        .resolve(
            jobs[0].attempt_id,
            onejob::store::Resolution::Failed,
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
    let cancelled = store.cancel_job(jobs[1].job_id, &actor).await.unwrap();
    assert_eq!(lossy.lost(), 2, "the commit's reply was lost");
    assert!(cancelled.is_ok(), "reported done: {cancelled:?}");
    let job = env.store.job(jobs[1].job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);

    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM audit WHERE reason = 'lost reply'")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 2, "each action recorded once");
}

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
    env.store
        .pool()
        .execute(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} SET lock_timeout = '300ms'",
            env.name
        )))
        .await
        .unwrap();
    let server = common::pg_base()
        .rsplit('@')
        .next()
        .expect("a host")
        .to_owned();
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
