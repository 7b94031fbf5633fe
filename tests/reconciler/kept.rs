//! Kept answers: an answer kept on its attempt is settled as a live one
//! would be; one whose rows are held waits behind the others.

use onejob::domain::JobStatus;
use onejob::roles::reconciler::kept::Kept;

use super::Bench;
use crate::common::database::{Holder, started, success};

async fn answer_kept(bench: &Bench, job: onejob::domain::JobId) -> bool {
    sqlx::query_scalar("SELECT bool_or(answer IS NOT NULL) FROM attempts WHERE job_id = $1")
        .bind(job.0)
        .fetch_one(bench.env.store.pool())
        .await
        .unwrap()
}

/// A kept answer is settled by one run: the job succeeds with it, and the
/// answer is cleared. A second run finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_answer_is_settled_as_a_live_one() {
    let bench = Bench::new("").await;
    let store = &bench.env.store;
    let s = started(store, "kept", 1).await.remove(0);
    assert!(store.kept().keep_answer(&success(&s), None).await.unwrap());
    assert_eq!(bench.run(&Kept).await, 1);
    let job = store.jobs().job(s.job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Succeeded);
    assert_eq!(job.completed_by, Some(s.attempt_id));
    assert!(
        !answer_kept(&bench, s.job_id).await,
        "cleared as it settled"
    );
    assert_eq!(bench.run(&Kept).await, 0);
}

/// Of two kept answers, the one whose rows are held is left kept, and the
/// other settled in the same run; released, the held one is settled by a
/// later run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_answer_whose_rows_are_held_waits_behind_the_others() {
    let bench = Bench::new("").await;
    let store = &bench.env.store;
    let both = started(store, "kept-held", 2).await;
    for s in &both {
        assert!(store.kept().keep_answer(&success(s), None).await.unwrap());
    }
    let held = Holder::hold_with_attempts(&bench.env.database_url, both[0].job_id).await;
    assert_eq!(bench.run(&Kept).await, 1, "the free one settles");
    let free = store.jobs().job(both[1].job_id).await.unwrap().unwrap();
    assert_eq!(free.status, JobStatus::Succeeded);
    assert!(answer_kept(&bench, both[0].job_id).await, "still kept");
    held.release().await;
    assert_eq!(
        bench.run_until_done(&Kept, "the held answer's turn").await,
        1
    );
    let job = store.jobs().job(both[0].job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Succeeded);
}
