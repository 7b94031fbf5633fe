//! Races of known shape: two attempts finishing in reverse order, at the same
//! moment, in one flush, in flushes racing each other; and a settlement the
//! database refuses, beside its neighbours.

use std::sync::Arc;
use std::time::Duration;

use onejob::domain::{AttemptId, AttemptStatus, JobStatus};
use onejob::edges::store::{Finished, Settled, Started, Verdict};
use serde_json::json;

use super::{finished, new_job, settle, success, two_started_attempts};
use crate::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_later_of_two_reversed_attempts_is_discarded() {
    let env = common::store_env().await;
    let store = &env.store;
    let (job_id, a, b) = two_started_attempts(store, "reverse").await;

    // B started second and returns first: it wins.
    let (settled, publish) = store
        .settle()
        .finalize(&[success(&b)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Won]);
    assert_eq!(publish.len(), 1, "one job.succeeded event");
    let won = store.jobs().job(job_id).await.unwrap().unwrap();

    // A started first and returns last: discarded, its result never merged.
    let (settled, publish) = store
        .settle()
        .finalize(&[success(&a)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(
        settled,
        vec![Settled::Discarded {
            winner: Some(b.attempt_id)
        }]
    );
    assert!(publish.is_empty(), "a discarded result emits no event");

    let job = store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Succeeded);
    assert_eq!(job.completed_by, Some(b.attempt_id));
    assert_eq!(
        job.result,
        Some(json!({ "summary": b.attempt_id.to_string() }))
    );
    assert_eq!(job.version, 1);
    assert_eq!(
        (job.version, job.result.clone(), job.updated_at),
        (won.version, won.result, won.updated_at)
    );
    let loser = job.attempts.iter().find(|x| x.id == a.attempt_id).unwrap();
    assert_eq!(loser.status, AttemptStatus::Discarded);
    assert_eq!(
        loser.usage,
        Some(json!({"total_tokens": 10})),
        "the loser's spend stays visible"
    );

    // A redelivered success of either attempt changes nothing.
    let (settled, _) = store
        .settle()
        .finalize(&[success(&a), success(&b)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Stale, Settled::Stale]);
    let again = store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(
        (again.version, again.completed_by, again.updated_at),
        (1, Some(b.attempt_id), job.updated_at)
    );

    // The database itself refuses to change a terminal job.
    let err = sqlx::query("UPDATE jobs SET error = 'tamper' WHERE id = $1")
        .bind(job_id.0)
        .execute(store.pool())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("can never change again"), "{err}");
}

/// Both attempts finish at the same moment on separate connections, 200 times:
/// exactly one wins each time, and the job carries the winner's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_finishers_have_exactly_one_winner() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    for i in 0..200 {
        let (job_id, a, b) = two_started_attempts(&store, &format!("race-{i}")).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let run = |s: Started| {
            let store = store.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                settle(&store, &[success(&s)]).await.remove(0)
            })
        };
        let (ra, rb) = tokio::join!(run(a.clone()), run(b.clone()));
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        let winner = match (&ra, &rb) {
            (Settled::Won, Settled::Discarded { winner }) => {
                assert_eq!(*winner, Some(a.attempt_id));
                a.attempt_id
            }
            (Settled::Discarded { winner }, Settled::Won) => {
                assert_eq!(*winner, Some(b.attempt_id));
                b.attempt_id
            }
            other => panic!("round {i}: expected one winner, got {other:?}"),
        };
        let job = store.jobs().job(job_id).await.unwrap().unwrap();
        assert_eq!(job.completed_by, Some(winner));
        assert_eq!(job.result, Some(json!({ "summary": winner.to_string() })));
        assert_eq!(job.version, 1);
    }
}

/// The attempt path settles in flushes: a hedge and its primary can finish in
/// the same transaction. 100 times, both succeed in one flush (in either
/// order): exactly one wins, the other is discarded naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_attempts_of_one_job_in_one_flush_have_exactly_one_winner() {
    let env = common::store_env().await;
    let store = &env.store;
    for i in 0..100 {
        let (job_id, a, b) = two_started_attempts(store, &format!("flush-{i}")).await;
        let flush = if i % 2 == 0 {
            [success(&a), success(&b)]
        } else {
            [success(&b), success(&a)]
        };
        let (settled, publish) = store
            .settle()
            .finalize(&flush, &common::give_up)
            .await
            .unwrap();
        let winner = match settled.as_slice() {
            [Settled::Won, Settled::Discarded { winner }] => {
                assert_eq!(*winner, Some(flush[0].attempt_id));
                flush[0].attempt_id
            }
            [Settled::Discarded { winner }, Settled::Won] => {
                assert_eq!(*winner, Some(flush[1].attempt_id));
                flush[1].attempt_id
            }
            other => panic!("round {i}: expected one winner, got {other:?}"),
        };
        assert_eq!(publish.len(), 1, "round {i}: one job.succeeded event");
        let job = store.jobs().job(job_id).await.unwrap().unwrap();
        assert_eq!(job.completed_by, Some(winner));
        assert_eq!(job.result, Some(json!({ "summary": winner.to_string() })));
        assert_eq!(job.version, 1);
    }
}

/// Two flushes race on separate connections, one holding the main attempts of
/// 20 jobs and the other their hedges, 30 times: the transactions lock the same
/// jobs in whatever order, and still every job has exactly one winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_flushes_have_exactly_one_winner_per_job() {
    const JOBS: usize = 20;
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    for round in 0..30 {
        let mut mains = Vec::new();
        let mut hedges = Vec::new();
        let mut jobs = Vec::new();
        for j in 0..JOBS {
            let (job, a, b) = two_started_attempts(&store, &format!("flushes-{round}-{j}")).await;
            jobs.push(job);
            mains.push(success(&a));
            hedges.push(success(&b));
        }
        // Opposite orders make the two transactions meet from both ends.
        hedges.reverse();
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let run = |flush: Vec<Finished>| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let settled = settle(&store, &flush).await;
                flush
                    .iter()
                    .map(|f| f.attempt_id)
                    .zip(settled)
                    .collect::<Vec<_>>()
            })
        };
        let (m, h) = tokio::join!(run(mains), run(hedges));
        let outcomes: std::collections::HashMap<AttemptId, Settled> =
            m.unwrap().into_iter().chain(h.unwrap()).collect();
        for job_id in jobs {
            let job = store.jobs().job(job_id).await.unwrap().unwrap();
            let winner = job.completed_by.expect("every job has a winner");
            let won: Vec<_> = job
                .attempts
                .iter()
                .filter(|a| outcomes.get(&a.id) == Some(&Settled::Won))
                .map(|a| a.id)
                .collect();
            assert_eq!(won, vec![winner], "round {round}: one winner per job");
            for attempt in job.attempts.iter().filter(|a| a.id != winner) {
                assert_eq!(attempt.status, AttemptStatus::Discarded);
                assert_eq!(
                    outcomes.get(&attempt.id),
                    Some(&Settled::Discarded {
                        winner: Some(winner)
                    })
                );
            }
            assert_eq!(job.version, 1);
        }
    }
}

/// A settlement Postgres refuses (a result it cannot store) fails alone: the
/// other settlements of its flush are written, and it is reported as refused
/// with nothing of it written.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_settlement_never_fails_its_neighbours() {
    let env = common::store_env().await;
    let store = &env.store;
    let mut started = Vec::new();
    for key in ["left", "poisoned", "right"] {
        let new = new_job(key);
        let attempt = new.attempt_id;
        store.admission().admit(&[new]).await.unwrap();
        started.push(
            store
                .settle()
                .start("primary", &[attempt], Duration::from_secs(30))
                .await
                .unwrap()
                .remove(0),
        );
    }
    // jsonb cannot hold U+0000: SQLSTATE 22P05.
    let poisoned = finished(
        &started[1],
        Verdict::Succeeded(json!({ "summary": "nul \u{0} here" })),
    );
    let flush = [success(&started[0]), poisoned, success(&started[2])];
    let (settled, publish) = store
        .settle()
        .finalize(&flush, &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled[0], Settled::Won);
    assert!(
        matches!(&settled[1], Settled::Refused { error } if error.contains("unsupported Unicode escape sequence")),
        "{:?}",
        settled[1]
    );
    assert_eq!(settled[2], Settled::Won);
    assert_eq!(publish.len(), 2, "the two winners' events");
    for (s, status) in started.iter().zip([
        JobStatus::Succeeded,
        JobStatus::Running,
        JobStatus::Succeeded,
    ]) {
        let job = store.jobs().job(s.job_id).await.unwrap().unwrap();
        assert_eq!(job.status, status, "{}", s.job_id);
    }
    let left_open = store.jobs().job(started[1].job_id).await.unwrap().unwrap();
    assert_eq!(left_open.attempts[0].status, AttemptStatus::Started);
}
