//! A claim the database lost (a failover under asynchronous replication):
//! the worker's call was made under it, and its answer comes back to an
//! attempt that is `queued` again, while the lost-message pass may be
//! handing the same attempt to another worker.

use std::sync::Arc;
use std::time::Duration;

use onejob::domain::{AttemptId, AttemptStatus, JobStatus};
use onejob::edges::store::{Admission, Settled, Store};
use uuid::Uuid;

use super::{new_job, settle, success};
use crate::common;

/// The lost claim's answer races a claim of the same attempt by another
/// worker, on two connections, a hundred times: the answer is kept every
/// time (the attempt wins with it, whether or not the other claim started
/// it first), and a claim that comes after the settlement starts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_claims_answer_is_kept_however_it_races_a_claim_again() {
    let env = common::store_env().await;
    let store = Arc::new(env.store.clone());
    let (mut claimed_first, mut settled_first) = (0, 0);
    for round in 0..100 {
        let new = new_job(&format!("lost-claim-{round}"));
        let (job_id, attempt) = (new.job_id, new.attempt_id);
        let admitted = store.admission().admit(&[new]).await.unwrap();
        assert!(matches!(admitted[0], Admission::Created { .. }));
        let started = store
            .settle()
            .start("primary", &[attempt], Duration::from_secs(30))
            .await
            .unwrap()
            .remove(0);
        lose_the_claim(&store, attempt).await;

        let answer = {
            let store = store.clone();
            let finished = success(&started);
            tokio::spawn(async move { settle(&store, &[finished]).await })
        };
        let again = {
            let store = store.clone();
            tokio::spawn(async move { claim_until_answered(&store, attempt).await })
        };
        let (settled, claimed_again) = (answer.await.unwrap(), again.await.unwrap());
        assert_eq!(settled, vec![Settled::Won], "round {round}");
        if claimed_again {
            claimed_first += 1;
        } else {
            settled_first += 1;
        }

        let job = store.jobs().job(job_id).await.unwrap().unwrap();
        assert_eq!(
            (job.status, job.completed_by),
            (JobStatus::Succeeded, Some(attempt)),
            "round {round}"
        );
        let kept = job.attempts.iter().find(|a| a.id == attempt).unwrap();
        assert_eq!(kept.status, AttemptStatus::Succeeded, "round {round}");
        assert!(kept.usage.is_some(), "round {round}: its usage is kept");
        assert!(
            !claim_until_answered(&store, attempt).await,
            "round {round}: a claim after the settlement started the attempt"
        );
    }
    eprintln!(
        "the other claim started the attempt before the settlement in {claimed_first} rounds, after it in {settled_first}"
    );
}

/// The attempt as it was before its claim, and its job `queued`: what a
/// failover that lost the claim's commit leaves.
async fn lose_the_claim(store: &Store, attempt: AttemptId) {
    sqlx::query(
        "WITH a AS (UPDATE attempts SET status = 'queued', claim = NULL, started_at = NULL,
                    deadline_at = NULL WHERE id = $1 RETURNING job_id)
         UPDATE jobs SET status = 'queued' FROM a WHERE jobs.id = a.job_id",
    )
    .bind(attempt.0)
    .execute(store.pool())
    .await
    .unwrap();
}

/// Claims `attempt` as another worker would, again while its job row is
/// held or Postgres breaks a lock cycle; whether the claim started it.
async fn claim_until_answered(store: &Store, attempt: AttemptId) -> bool {
    loop {
        match store
            .settle()
            .claim(
                "primary",
                "none",
                &[attempt],
                Duration::from_secs(30),
                Uuid::new_v4(),
            )
            .await
        {
            Ok(claim) if claim.busy.is_empty() => {
                return claim.started.iter().any(|s| s.attempt_id == attempt);
            }
            Ok(_) => {}
            Err(e) if e.is_contention() => {}
            Err(e) => panic!("the claim failed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
