//! A worker that vanished mid-call leaves its attempt `unknown`, and nothing
//! new starts beside it.

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};

use super::new_job;
use crate::common;

/// A started attempt whose worker vanished becomes `unknown` once its deadline and
/// the grace period pass, never `failed`; and then no hedge or retry may start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vanished_worker_leaves_an_unknown_attempt() {
    let env = common::store_env().await;
    let store = &env.store;
    let new = new_job("vanish");
    let (job_id, attempt) = (new.job_id, new.attempt_id);
    store.admission().admit(&[new]).await.unwrap();
    store
        .settle()
        .start("primary", &[attempt], Duration::from_millis(50))
        .await
        .unwrap();
    // A redelivered message finds the attempt started: nothing to do.
    assert!(
        store
            .settle()
            .start("primary", &[attempt], Duration::from_millis(50))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store
            .sweeps()
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
                .sweeps()
                .expire_vanished(Duration::from_millis(100))
                .await
                .unwrap();
            (!ids.is_empty()).then_some(ids)
        },
    )
    .await;
    let job = store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown);
    assert_eq!(job.attempts[0].status, AttemptStatus::Unknown);
    assert!(
        store
            .sweeps()
            .hedge(job_id, "fallback")
            .await
            .unwrap()
            .is_none(),
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
