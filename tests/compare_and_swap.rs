//! When attempts race, the compare-and-swap on the job row lets exactly one win; a
//! late arrival is discarded whole, never merged. These tests drive the store
//! directly, on the real Postgres, with concurrent connections.

mod common;

use std::sync::Arc;
use std::time::Duration;

use onejob::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use onejob::store::{Admission, Finished, NewJob, Settled, Started, Store, Verdict};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::json;

/// A validated intent for the primary provider, ready to admit.
fn new_job(key: &str) -> NewJob {
    common::new_job("acct_cas", key, key)
}

/// A job whose main attempt started first and whose hedge started second.
async fn two_started_attempts(store: &Store, key: &str) -> (JobId, Started, Started) {
    let new = new_job(key);
    let (job_id, first) = (new.job_id, new.attempt_id);
    let admitted = store.admit(&[new]).await.unwrap();
    assert!(matches!(admitted[0], Admission::Created { .. }));
    let a = store
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    let (hedge, _) = store
        .hedge(job_id, "fallback")
        .await
        .unwrap()
        .expect("hedge allowed");
    let b = store
        .start("fallback", &[hedge], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    assert_eq!((a.version, b.version), (0, 0));
    (job_id, a, b)
}

fn finished(s: &Started, verdict: Verdict) -> Finished {
    Finished {
        attempt_id: s.attempt_id,
        job_id: s.job_id,
        version: s.version,
        provider_request_id: Some(format!("req-{}", s.attempt_id)),
        usage: Some(json!({"total_tokens": 10})),
        verdict,
    }
}

fn success(s: &Started) -> Finished {
    finished(
        s,
        Verdict::Succeeded(json!({ "summary": s.attempt_id.to_string() })),
    )
}

/// Settles `batch` as the attempt path does (see [`common::settle_with`]).
async fn settle(store: &Store, batch: &[Finished]) -> Vec<Settled> {
    common::settle_with(store, batch, &common::give_up).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_later_of_two_reversed_attempts_is_discarded() {
    let env = common::store_env().await;
    let store = &env.store;
    let (job_id, a, b) = two_started_attempts(store, "reverse").await;

    // B started second and returns first: it wins.
    let (settled, publish) = store
        .finalize(&[success(&b)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Won]);
    assert_eq!(publish.len(), 1, "one job.succeeded event");
    let won = store.job(job_id).await.unwrap().unwrap();

    // A started first and returns last: discarded, its result never merged.
    let (settled, publish) = store
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

    let job = store.job(job_id).await.unwrap().unwrap();
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
        .finalize(&[success(&a), success(&b)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Stale, Settled::Stale]);
    let again = store.job(job_id).await.unwrap().unwrap();
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
        let job = store.job(job_id).await.unwrap().unwrap();
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
        let (settled, publish) = store.finalize(&flush, &common::give_up).await.unwrap();
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
        let job = store.job(job_id).await.unwrap().unwrap();
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
            let job = store.job(job_id).await.unwrap().unwrap();
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
        store.admit(&[new]).await.unwrap();
        started.push(
            store
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
    let (settled, publish) = store.finalize(&flush, &common::give_up).await.unwrap();
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
        let job = store.job(s.job_id).await.unwrap().unwrap();
        assert_eq!(job.status, status, "{}", s.job_id);
    }
    let left_open = store.job(started[1].job_id).await.unwrap().unwrap();
    assert_eq!(left_open.attempts[0].status, AttemptStatus::Started);
}

#[derive(Clone, Debug)]
enum Kind {
    Success,
    Failure,
    Unknown,
}

#[derive(Clone, Debug)]
struct Finisher {
    /// 0: the main attempt, 1: the hedge.
    attempt: usize,
    kind: Kind,
    delay_us: u64,
}

fn finisher() -> impl Strategy<Value = Finisher> {
    (
        0..2usize,
        prop_oneof![3 => Just(Kind::Success), 1 => Just(Kind::Failure), 1 => Just(Kind::Unknown)],
        0..1500u64,
    )
        .prop_map(|(attempt, kind, delay_us)| Finisher {
            attempt,
            kind,
            delay_us,
        })
}

/// Thousands of random interleavings of concurrent finalizers (each attempt
/// finishing once or several times, as redeliveries do, with any outcome, at any
/// moment, alone or batched together): never more than one winner; exactly one
/// whenever a success reached an open attempt; the job holds the winner's result.
#[test]
fn random_interleavings_never_have_two_winners() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let env = rt.block_on(common::store_env());
    let store = Arc::new(env.store.clone());
    let cases: u32 = match std::env::var("ONEJOB_CAS_CASES") {
        Err(_) => 2000,
        Ok(c) => c
            .parse()
            .unwrap_or_else(|e| panic!("ONEJOB_CAS_CASES={c:?} is not a number of cases ({e})")),
    };
    // Zero cases would pass without running one interleaving.
    assert!(
        cases > 0,
        "ONEJOB_CAS_CASES=0 runs no case and proves nothing: give at least 1 (default 2000)"
    );
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = (prop::collection::vec(finisher(), 1..6), any::<bool>());
    let case = std::sync::atomic::AtomicU32::new(0);
    runner
        .run(&strategy, |(finishers, batch_first_two)| {
            let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            let store = store.clone();
            rt.block_on(async move {
                let (job_id, a, b) = two_started_attempts(&store, &format!("prop-{}", uuid::Uuid::now_v7())).await;
                let attempts = [a, b];
                let to_finished = |f: &Finisher| {
                    let s = &attempts[f.attempt];
                    match f.kind {
                        Kind::Success => success(s),
                        Kind::Failure => finished(s, Verdict::Failed { error: "boom".into(), retryable: true, retry_after: None }),
                        Kind::Unknown => finished(s, Verdict::Unknown { error: "timeout".into() }),
                    }
                };
                // Optionally settle the first two finishers in one batch.
                let mut calls: Vec<(u64, Vec<Finished>)> = Vec::new();
                let mut rest = finishers.as_slice();
                if batch_first_two && finishers.len() >= 2 && finishers[0].attempt != finishers[1].attempt {
                    calls.push((finishers[0].delay_us, vec![to_finished(&finishers[0]), to_finished(&finishers[1])]));
                    rest = &finishers[2..];
                }
                calls.extend(rest.iter().map(|f| (f.delay_us, vec![to_finished(f)])));

                let tasks: Vec<_> = calls
                    .into_iter()
                    .map(|(delay, batch)| {
                        let store = store.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_micros(delay)).await;
                            let settled = settle(&store, &batch).await;
                            batch
                                .iter()
                                .map(|f| (f.attempt_id, matches!(f.verdict, Verdict::Succeeded(_))))
                                .zip(settled)
                                .map(|((a, success), s)| (a, success, s))
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                // Each finisher's attempt, whether it offered a success, and
                // what settling it did.
                let mut offered = Vec::new();
                for t in tasks {
                    offered.extend(t.await.unwrap());
                }
                let outcomes: Vec<(AttemptId, Settled)> =
                    offered.iter().map(|(a, _, s)| (*a, s.clone())).collect();
                let winners: Vec<AttemptId> = outcomes
                    .iter()
                    .filter(|(_, s)| *s == Settled::Won)
                    .map(|(a, _)| *a)
                    .collect();
                let job = store.job(job_id).await.unwrap().unwrap();
                let ctx = format!("case {case}: {finishers:?} batch={batch_first_two} outcomes={outcomes:?} job={:?}/{:?}", job.status, job.completed_by);
                assert!(winners.len() <= 1, "{ctx}");
                match winners.first() {
                    Some(w) => {
                        assert_eq!(job.status, JobStatus::Succeeded, "{ctx}");
                        assert_eq!(job.completed_by, Some(*w), "{ctx}");
                        assert_eq!(job.result, Some(json!({ "summary": w.to_string() })), "{ctx}");
                        assert_eq!(job.version, 1, "{ctx}");
                        let succeeded: Vec<_> = job.attempts.iter().filter(|x| x.status == AttemptStatus::Succeeded).collect();
                        assert_eq!(succeeded.len(), 1, "{ctx}");
                        assert_eq!(succeeded[0].id, *w, "{ctx}");
                    }
                    None => {
                        assert_eq!(job.completed_by, None, "{ctx}");
                        assert_eq!(job.result, None, "{ctx}");
                        assert_ne!(job.status, JobStatus::Succeeded, "{ctx}");
                        assert!(job.attempts.iter().all(|x| x.status != AttemptStatus::Succeeded), "{ctx}");
                        // With no winner, nothing can have been discarded: a success
                        // that found its attempt open would have won.
                        assert!(!outcomes.iter().any(|(_, s)| matches!(s, Settled::Discarded { .. })), "{ctx}");
                        // So every success offered came too late for its attempt:
                        // a definite failure of that same attempt had closed it
                        // (`started` and `unknown` are both open to a success). Its
                        // outcome says it changed nothing, and the attempt is
                        // `failed` in the database.
                        for (attempt, success, settled) in &offered {
                            if !*success {
                                continue;
                            }
                            assert_eq!(*settled, Settled::Stale, "{ctx}: a success of {attempt} that did not win");
                            let row = job.attempts.iter().find(|x| x.id == *attempt).expect("the attempt's row");
                            assert_eq!(row.status, AttemptStatus::Failed, "{ctx}: a success of {attempt} that did not win");
                            let index = usize::from(*attempt != attempts[0].attempt_id);
                            assert!(
                                finishers.iter().any(|f| f.attempt == index && matches!(f.kind, Kind::Failure)),
                                "{ctx}: {attempt} was closed without a failure"
                            );
                        }
                    }
                }
                // Every discarded attempt names the winner.
                for (_, s) in &outcomes {
                    if let Settled::Discarded { winner } = s {
                        assert_eq!(*winner, job.completed_by, "{ctx}");
                    }
                }
                // A failed job got there only once both attempts had ended.
                if job.status == JobStatus::Failed {
                    assert!(job.attempts.iter().all(|x| x.status.is_terminal()), "{ctx}");
                    assert_eq!(job.version, 1, "{ctx}");
                }
            });
            Ok(())
        })
        .unwrap();
    drop(env);
}

/// A started attempt whose worker vanished becomes `unknown` once its deadline and
/// the grace period pass, never `failed`; and then no hedge or retry may start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vanished_worker_leaves_an_unknown_attempt() {
    let env = common::store_env().await;
    let store = &env.store;
    let new = new_job("vanish");
    let (job_id, attempt) = (new.job_id, new.attempt_id);
    store.admit(&[new]).await.unwrap();
    store
        .start("primary", &[attempt], Duration::from_millis(50))
        .await
        .unwrap();
    // A redelivered message finds the attempt started: nothing to do.
    assert!(
        store
            .start("primary", &[attempt], Duration::from_millis(50))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .expire_vanished(Duration::from_secs(60))
            .await
            .unwrap()
            .is_empty(),
        "within grace"
    );
    common::wait_for(
        "the attempt to be declared vanished",
        Duration::from_secs(10),
        || async {
            let ids = store
                .expire_vanished(Duration::from_millis(100))
                .await
                .unwrap();
            (!ids.is_empty()).then_some(ids)
        },
    )
    .await;
    let job = store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown);
    assert_eq!(job.attempts[0].status, AttemptStatus::Unknown);
    assert!(
        store.hedge(job_id, "fallback").await.unwrap().is_none(),
        "no hedge beside an unknown"
    );
    // A second open attempt in the main lane is refused by the database itself.
    let err = sqlx::query(
        "INSERT INTO attempts (id, job_id, number, provider) VALUES ($1, $2, 2, 'primary')",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(job_id.0)
    .execute(store.pool())
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("attempts_one_open_per_lane"),
        "{err}"
    );
}
