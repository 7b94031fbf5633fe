//! Vanished workers: a started attempt silent past its deadline and the
//! grace becomes `unknown`, never `failed`; one still within them, or whose
//! rows are held, is left for a later run.

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::roles::reconciler::vanished::Vanished;

use super::Bench;
use crate::common::database::Holder;
use crate::common::new_job;

/// Of two started attempts, the one past its deadline and the grace becomes
/// `unknown` (and its job with it); the other, within its deadline, is left
/// started. A second run finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_silent_past_its_deadline_and_grace_becomes_unknown() {
    let bench = Bench::new("vanished_grace = \"100ms\"").await;
    let store = &bench.env.store;
    let (gone, alive) = (new_job("acct_v", "v-1", "a"), new_job("acct_v", "v-2", "b"));
    let (gone_job, alive_job) = (gone.job_id, alive.job_id);
    let (gone_attempt, alive_attempt) = (gone.attempt_id, alive.attempt_id);
    store.admission().admit(&[gone, alive]).await.unwrap();
    let settle = store.settle();
    settle
        .start("primary", &[gone_attempt], Duration::from_millis(50))
        .await
        .unwrap();
    settle
        .start("primary", &[alive_attempt], Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(
        bench
            .run_until_done(&Vanished, "the deadline to pass")
            .await,
        1
    );
    let job = store.jobs().job(gone_job).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown);
    assert_eq!(job.attempts[0].status, AttemptStatus::Unknown);
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(error.starts_with("worker_vanished"), "{error}");
    let alive = store.jobs().job(alive_job).await.unwrap().unwrap();
    assert_eq!(alive.attempts[0].status, AttemptStatus::Started);
    assert_eq!(bench.run(&Vanished).await, 0);
}

/// An attempt whose rows another session holds is skipped, and the run does
/// not fail; once they are released, the next run takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_whose_rows_are_held_waits_for_the_next_run() {
    let bench = Bench::new("vanished_grace = \"100ms\"").await;
    let store = &bench.env.store;
    let new = new_job("acct_v", "v-held", "held");
    let (job_id, attempt) = (new.job_id, new.attempt_id);
    store.admission().admit(&[new]).await.unwrap();
    store
        .settle()
        .start("primary", &[attempt], Duration::from_millis(10))
        .await
        .unwrap();
    let held = Holder::hold_with_attempts(&bench.env.database_url, job_id).await;
    // Past the deadline and the grace, as the database's own clock says.
    crate::common::wait_for("the grace to pass", Duration::from_secs(10), || async {
        let due = bench
            .count("SELECT count(*) FROM attempts WHERE deadline_at + interval '100 ms' < now()")
            .await;
        (due == 1).then_some(())
    })
    .await;
    assert_eq!(bench.run(&Vanished).await, 0, "held: left for later");
    let job = store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Started);
    held.release().await;
    assert_eq!(bench.run(&Vanished).await, 1);
}
