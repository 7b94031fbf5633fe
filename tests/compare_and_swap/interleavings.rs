//! Thousands of random interleavings of concurrent finalizers, under proptest.

use std::sync::Arc;
use std::time::Duration;

use onejob::domain::{AttemptId, AttemptStatus, JobStatus};
use onejob::edges::store::{Finished, JobView, Settled, Started, Store, Verdict};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::json;

use super::{finished, settle, success, two_started_attempts};
use crate::common;

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
            rt.block_on(one_interleaving(store, case, finishers, batch_first_two));
            Ok(())
        })
        .unwrap();
    drop(env);
}

/// Each finisher's attempt, whether it offered a success, and what settling
/// it did.
type Offered = Vec<(AttemptId, bool, Settled)>;

/// One case of the interleavings: `finishers` settle a fresh job's two
/// attempts concurrently (the first two in one batch if `batch_first_two`),
/// and what they did is checked.
async fn one_interleaving(
    store: Arc<Store>,
    case: u32,
    finishers: Vec<Finisher>,
    batch_first_two: bool,
) {
    let (job_id, a, b) =
        two_started_attempts(&store, &format!("prop-{}", uuid::Uuid::now_v7())).await;
    let attempts = [a, b];
    let offered = finish_concurrently(&store, &attempts, &finishers, batch_first_two).await;
    let outcomes: Vec<(AttemptId, Settled)> =
        offered.iter().map(|(a, _, s)| (*a, s.clone())).collect();
    let winners: Vec<AttemptId> = outcomes
        .iter()
        .filter(|(_, s)| *s == Settled::Won)
        .map(|(a, _)| *a)
        .collect();
    let job = store.jobs().job(job_id).await.unwrap().unwrap();
    let ctx = format!(
        "case {case}: {finishers:?} batch={batch_first_two} outcomes={outcomes:?} job={:?}/{:?}",
        job.status, job.completed_by
    );
    assert!(winners.len() <= 1, "{ctx}");
    match winners.first() {
        Some(w) => {
            assert_eq!(job.status, JobStatus::Succeeded, "{ctx}");
            assert_eq!(job.completed_by, Some(*w), "{ctx}");
            assert_eq!(
                job.result,
                Some(json!({ "summary": w.to_string() })),
                "{ctx}"
            );
            assert_eq!(job.version, 1, "{ctx}");
            let succeeded: Vec<_> = job
                .attempts
                .iter()
                .filter(|x| x.status == AttemptStatus::Succeeded)
                .collect();
            assert_eq!(succeeded.len(), 1, "{ctx}");
            assert_eq!(succeeded[0].id, *w, "{ctx}");
        }
        None => no_winner(&job, &attempts, &finishers, &offered, &outcomes, &ctx),
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
}

/// Settles each finisher after its delay, all at once (the first two in one
/// batch if `batch_first_two` and they finish different attempts), and says
/// what each did.
async fn finish_concurrently(
    store: &Arc<Store>,
    attempts: &[Started; 2],
    finishers: &[Finisher],
    batch_first_two: bool,
) -> Offered {
    let to_finished = |f: &Finisher| {
        let s = &attempts[f.attempt];
        match f.kind {
            Kind::Success => success(s),
            Kind::Failure => finished(
                s,
                Verdict::Failed {
                    error: "boom".into(),
                    retryable: true,
                    retry_after: None,
                },
            ),
            Kind::Unknown => finished(
                s,
                Verdict::Unknown {
                    error: "timeout".into(),
                },
            ),
        }
    };
    // Optionally settle the first two finishers in one batch.
    let mut calls: Vec<(u64, Vec<Finished>)> = Vec::new();
    let mut rest = finishers;
    if batch_first_two && finishers.len() >= 2 && finishers[0].attempt != finishers[1].attempt {
        calls.push((
            finishers[0].delay_us,
            vec![to_finished(&finishers[0]), to_finished(&finishers[1])],
        ));
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
    let mut offered = Vec::new();
    for t in tasks {
        offered.extend(t.await.unwrap());
    }
    offered
}

/// With no winner, nothing can have been discarded, and every success offered
/// came too late for its attempt.
fn no_winner(
    job: &JobView,
    attempts: &[Started; 2],
    finishers: &[Finisher],
    offered: &Offered,
    outcomes: &[(AttemptId, Settled)],
    ctx: &str,
) {
    assert_eq!(job.completed_by, None, "{ctx}");
    assert_eq!(job.result, None, "{ctx}");
    assert_ne!(job.status, JobStatus::Succeeded, "{ctx}");
    assert!(
        job.attempts
            .iter()
            .all(|x| x.status != AttemptStatus::Succeeded),
        "{ctx}"
    );
    // With no winner, nothing can have been discarded: a success
    // that found its attempt open would have won.
    assert!(
        !outcomes
            .iter()
            .any(|(_, s)| matches!(s, Settled::Discarded { .. })),
        "{ctx}"
    );
    // So every success offered came too late for its attempt:
    // a definite failure of that same attempt had closed it
    // (`started` and `unknown` are both open to a success). Its
    // outcome says it changed nothing, and the attempt is
    // `failed` in the database.
    for (attempt, success, settled) in offered {
        if !*success {
            continue;
        }
        assert_eq!(
            *settled,
            Settled::Stale,
            "{ctx}: a success of {attempt} that did not win"
        );
        let row = job
            .attempts
            .iter()
            .find(|x| x.id == *attempt)
            .expect("the attempt's row");
        assert_eq!(
            row.status,
            AttemptStatus::Failed,
            "{ctx}: a success of {attempt} that did not win"
        );
        let index = usize::from(*attempt != attempts[0].attempt_id);
        assert!(
            finishers
                .iter()
                .any(|f| f.attempt == index && matches!(f.kind, Kind::Failure)),
            "{ctx}: {attempt} was closed without a failure"
        );
    }
}
