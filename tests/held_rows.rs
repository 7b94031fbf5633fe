//! A row held under someone else's lock (an operator's open transaction, a
//! migration, a long report) costs only the settlement or claim that needs it
//! a later try: never its neighbours, never the answer, and a job whose calls
//! are still in flight is never pruned.

use onejob_test_support as common;

use std::sync::Arc;
use std::time::Duration;

use common::database::{
    Holder, attempt_status, give_up, soon, started, success, with_lock_timeout,
};
use common::{P, TestEnv, config, config_for, mock, new_job, store_env, submit, wait_for};
use futures_util::future::join_all;
use onejob::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use onejob::edges::store::{Actor, Finished, Settled, Verdict};
use onejob::mock::MockOptions;
use onejob_producer::Producer;
use serde_json::json;
use sqlx::Executor;

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
    let (settled, _) = store.settle().finalize(&finished, &give_up).await.unwrap();
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
        .settle()
        .finalize(std::slice::from_ref(&finished[3]), &give_up)
        .await
        .unwrap();
    assert_eq!(again, vec![Settled::Busy]);

    held.release().await;
    let (after, _) = store
        .settle()
        .finalize(std::slice::from_ref(&finished[3]), &give_up)
        .await
        .unwrap();
    assert_eq!(after, vec![Settled::Won]);
    let job = store.jobs().job(jobs[3].job_id).await.unwrap().unwrap();
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
    env.store.admission().admit(&news).await.unwrap();
    let held = Holder::hold(&env.database_url, held_job).await;

    let token = uuid::Uuid::now_v7();
    let claim = soon(
        "the claim",
        env.store
            .settle()
            .claim("primary", "none", &attempts, Duration::from_secs(30), token),
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
        env.store.sweeps().expire_vanished(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    assert_eq!(marked.len(), 2, "the two attempts whose jobs are free");
    assert!(!marked.contains(&attempts[0]));
    held.release().await;

    // Released, the held claim goes through.
    let claim = env
        .store
        .settle()
        .claim(
            "primary",
            "none",
            &[attempts[1]],
            Duration::from_secs(30),
            token,
        )
        .await
        .unwrap();
    assert_eq!(claim.started.len(), 1);
    assert!(claim.busy.is_empty());
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
    common::database::set_lock_timeout(&env).await;
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
        held.push((JobId(job), AttemptId(attempt)));
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
    neighbours_succeed_and_held_answers_are_kept(&env, &others, &held).await;

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

/// Every neighbour in `others` succeeds while the rows of `held` are held, and
/// each held job's answer is kept on its attempt, which stays open.
async fn neighbours_succeed_and_held_answers_are_kept(
    env: &TestEnv,
    others: &[JobId],
    held: &[(JobId, AttemptId)],
) {
    wait_for(
        "the 27 neighbours to succeed while the rows are held",
        Duration::from_secs(20),
        || async {
            for job in others {
                if env.store.jobs().job(*job).await.unwrap()?.status != JobStatus::Succeeded {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    for (job, attempt) in held {
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
        let view = env.store.jobs().job(job).await.unwrap()?;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_job_whose_calls_are_in_flight_is_not_pruned() {
    let env = store_env().await;
    let jobs = started(&env.store, "prune", 2).await;
    let (busy, idle) = (&jobs[0], &jobs[1]);
    for s in [busy, idle] {
        env.store
            .jobs()
            .cancel(s.job_id, &Actor::cli(Some("test")))
            .await
            .unwrap()
            .unwrap();
    }
    // The idle job's call has ended; the busy job's is still in flight.
    let (settled, _) = env
        .store
        .settle()
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
    let policy = onejob::edges::store::Policy::uniform(onejob::settings::config::Retention {
        succeeded: Duration::from_secs(1),
        failed: Duration::from_secs(1),
        cancelled: Duration::from_secs(1),
    });
    let pass = env
        .store
        .retention()
        .prune_jobs(&policy, 100, false)
        .await
        .unwrap();
    assert_eq!(
        pass.pruned.jobs, 1,
        "only the job whose calls have all ended"
    );
    assert!(env.store.jobs().job(idle.job_id).await.unwrap().is_none());
    // Its answer arrives a moment later: it is discarded, its spend kept.
    let (settled, _) = env
        .store
        .settle()
        .finalize(&[success(busy)], &give_up)
        .await
        .unwrap();
    assert!(
        matches!(settled[0], Settled::Discarded { .. }),
        "{settled:?}"
    );
    let job = env.store.jobs().job(busy.job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded);
    assert_eq!(job.attempts[0].usage, Some(json!({"total_tokens": 10})));
    // Now every call has ended, it may go.
    let pass = env
        .store
        .retention()
        .prune_jobs(&policy, 100, false)
        .await
        .unwrap();
    assert_eq!(pass.pruned.jobs, 1);
}
