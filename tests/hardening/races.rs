//! Settlements racing each other behind a barrier, 15 rounds of 16 jobs: a
//! start against a timeout, a win against a timeout, a cancellation against a
//! retry and against the vanished-worker sweep. None leaves an attempt that
//! contradicts its job.

use onejob::policy::next::{FailedJob, NextStep};
use std::sync::Arc;
use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::edges::store::Verdict;
use serde_json::json;

use super::{finished, started, started_hedge, timed_out};
use crate::common;

/// Item 7: `start` used to write `running` over a job that a concurrent timeout
/// had just made `unknown`, so a hedge could call its provider while the job was
/// blocked. Many jobs race a hedge's start against the primary's timeout behind
/// a barrier; afterwards a job with an unknown attempt is always `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_start_never_overwrites_unknown() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let mut overwritten = 0;
    let mut hedges_started = 0;
    for round in 0..15 {
        let mut pairs = Vec::new();
        for i in 0..16 {
            let (job_id, primary) = started(&store, &format!("race-{round}-{i}")).await;
            let hedge = store
                .sweeps()
                .hedge(job_id, "fallback")
                .await
                .unwrap()
                .unwrap();
            pairs.push((job_id, primary, hedge));
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(pairs.len() * 2));
        let mut tasks = Vec::new();
        for (_, primary, hedge) in &pairs {
            let (s, b, h) = (store.clone(), barrier.clone(), *hedge);
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                s.settle()
                    .start("fallback", &[h], Duration::from_secs(30))
                    .await
                    .unwrap()
                    .len()
            }));
            let (s, b, p) = (store.clone(), barrier.clone(), timed_out(primary));
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                common::settle_with(&s, &[p], &common::give_up).await;
                0
            }));
        }
        for t in tasks {
            hedges_started += t.await.unwrap();
        }
        for (job_id, primary, _) in &pairs {
            let job = store.jobs().job(*job_id).await.unwrap().unwrap();
            let primary = job
                .attempts
                .iter()
                .find(|a| a.id == primary.attempt_id)
                .unwrap();
            assert_eq!(primary.status, AttemptStatus::Unknown);
            if job.status != JobStatus::Unknown {
                overwritten += 1;
            }
        }
    }
    assert_eq!(
        overwritten, 0,
        "jobs left `running` beside an unknown attempt ({hedges_started} hedges started first)"
    );
}

/// Review of item 8: a hedge's win racing its primary's timeout. Whichever
/// commits first, no attempt is left `unknown` on the ended job (the win's
/// clean-up must see a timeout that committed while it waited for the job).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_win_racing_a_timeout_leaves_no_unknown_behind() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let mut stranded = 0;
    for round in 0..15 {
        let mut pairs = Vec::new();
        for i in 0..16 {
            let (job_id, primary) = started(&store, &format!("win-{round}-{i}")).await;
            let hedge = started_hedge(&store, job_id).await;
            pairs.push((job_id, primary, hedge));
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(pairs.len() * 2));
        let mut tasks = Vec::new();
        for (_, primary, hedge) in &pairs {
            let (s, b, f) = (store.clone(), barrier.clone(), timed_out(primary));
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                common::settle_with(&s, &[f], &common::give_up).await;
            }));
            let (s, b) = (store.clone(), barrier.clone());
            let f = finished(hedge, Verdict::Succeeded(json!({"summary": "s"})));
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                common::settle_with(&s, &[f], &common::give_up).await;
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for (job_id, _, _) in &pairs {
            let job = store.jobs().job(*job_id).await.unwrap().unwrap();
            assert_eq!(job.status, JobStatus::Succeeded);
            if job
                .attempts
                .iter()
                .any(|a| a.status == AttemptStatus::Unknown)
            {
                stranded += 1;
            }
        }
    }
    assert_eq!(stranded, 0, "succeeded jobs left with an unknown attempt");
}

/// Item 15: `cancel` used to update the attempts before it locked the job, so a
/// retry planned at the same moment could leave a `queued` attempt on a cancelled
/// job. Many cancellations race a failure whose retry is due at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_never_leaves_a_queued_attempt_behind() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let retry = |_: &FailedJob| NextStep::Retry {
        provider: "primary".into(),
        delay: Duration::ZERO,
    };
    let mut stranded = 0;
    for round in 0..15 {
        let mut jobs = Vec::new();
        for i in 0..16 {
            jobs.push(started(&store, &format!("cancel-{round}-{i}")).await);
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(jobs.len() * 2));
        let mut tasks = Vec::new();
        for (job_id, s) in &jobs {
            let (st, b, job_id) = (store.clone(), barrier.clone(), *job_id);
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                let _ = st
                    .jobs()
                    .cancel(job_id, &onejob::edges::store::Actor::cli(None))
                    .await
                    .unwrap();
            }));
            let (st, b) = (store.clone(), barrier.clone());
            let failed = finished(
                s,
                Verdict::Failed {
                    error: "provider_error: HTTP 500".into(),
                    retryable: true,
                    retry_after: None,
                },
            );
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                common::settle_with(&st, &[failed], &retry).await;
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for (job_id, _) in &jobs {
            let job = store.jobs().job(*job_id).await.unwrap().unwrap();
            assert_eq!(job.status, JobStatus::Cancelled);
            if job
                .attempts
                .iter()
                .any(|a| a.status == AttemptStatus::Queued)
            {
                stranded += 1;
            }
        }
    }
    assert_eq!(stranded, 0, "cancelled jobs left with a queued attempt");
}

/// Review of item 8: the vanished-worker sweep racing a cancellation. The sweep
/// must judge the job under its lock: no attempt is left `unknown` on the
/// cancelled job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vanished_sweep_racing_a_cancel_leaves_no_unknown_behind() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let mut stranded = 0;
    for round in 0..15 {
        let mut jobs = Vec::new();
        for i in 0..16 {
            let (job_id, s) = started(&store, &format!("vanish-{round}-{i}")).await;
            sqlx::query(
                "UPDATE attempts SET deadline_at = now() - interval '1 hour' WHERE id = $1",
            )
            .bind(s.attempt_id.0)
            .execute(store.pool())
            .await
            .unwrap();
            jobs.push(job_id);
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(jobs.len() + 1));
        let mut tasks = Vec::new();
        for job_id in &jobs {
            let (s, b, job_id) = (store.clone(), barrier.clone(), *job_id);
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                let _ = s
                    .jobs()
                    .cancel(job_id, &onejob::edges::store::Actor::cli(None))
                    .await
                    .unwrap();
            }));
        }
        let (s, b) = (store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            b.wait().await;
            // A deadlock with a cancellation is possible and harmless: the sweep
            // runs again on the reconciler's next pass, as here.
            while s.sweeps().expire_vanished(Duration::ZERO).await.is_err() {}
        }));
        for t in tasks {
            t.await.unwrap();
        }
        for job_id in &jobs {
            let job = store.jobs().job(*job_id).await.unwrap().unwrap();
            assert_eq!(job.status, JobStatus::Cancelled);
            if job
                .attempts
                .iter()
                .any(|a| a.status == AttemptStatus::Unknown)
            {
                stranded += 1;
            }
        }
    }
    assert_eq!(stranded, 0, "cancelled jobs left with an unknown attempt");
}
