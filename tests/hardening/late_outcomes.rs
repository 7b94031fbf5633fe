//! Outcomes that arrive once their job has ended, or while it is blocked: a
//! timeout after another attempt won, and a hedge turned away by an unknown.

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::edges::store::{Settled, Store, Verdict};
use onejob::mock::MockOptions;
use serde_json::json;

use super::{finished, started, started_hedge, timed_out};
use crate::common::{self, TestEnv, config, config_text, mock, wait_for, wait_for_status};

/// Item 8: an attempt that times out after another attempt won is `discarded`
/// with the reason, never `unknown` on an ended job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_after_the_job_ended_is_discarded() {
    let env = common::store_env().await;
    let store = &env.store;
    a_timeout_after_the_hedge_won(store).await;
    a_timeout_after_a_cancel(store).await;
    a_vanished_worker_after_a_cancel(store).await;

    // Nothing is left unknown: the gauge an operator alerts on stays clear.
    let gauges = store.jobs().gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_oldest_unknown_attempt_seconds 0\n"),
        "{gauges}"
    );
    assert!(gauges.contains("onejob_attempts{status=\"unknown\"} 0\n"));
}

/// The hedge wins, then the primary times out: discarded, naming the winner,
/// with the reason kept.
async fn a_timeout_after_the_hedge_won(store: &Store) {
    let (job_id, primary) = started(store, "hedge-won").await;
    let hedge = started_hedge(store, job_id).await;
    let (settled, _) = store
        .settle()
        .finalize(
            &[finished(
                &hedge,
                Verdict::Succeeded(json!({"summary": "s"})),
            )],
            &common::give_up,
        )
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Won]);
    let (settled, publish) = store
        .settle()
        .finalize(&[timed_out(&primary)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(
        settled,
        vec![Settled::Discarded {
            winner: Some(hedge.attempt_id)
        }]
    );
    assert!(publish.is_empty());
    let job = store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Succeeded);
    let late = job
        .attempts
        .iter()
        .find(|a| a.id == primary.attempt_id)
        .unwrap();
    assert_eq!(late.status, AttemptStatus::Discarded);
    let error = late.error.clone().unwrap_or_default();
    assert!(error.contains("timed out"), "the reason is kept: {error}");
}

/// A job cancelled with a call in flight, whose call then times out.
async fn a_timeout_after_a_cancel(store: &Store) {
    let (job_id, in_flight) = started(store, "cancelled").await;
    store
        .jobs()
        .cancel(job_id, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap()
        .unwrap();
    let (settled, _) = store
        .settle()
        .finalize(&[timed_out(&in_flight)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Discarded { winner: None }]);
    let job = store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded);
}

/// A worker that vanished mid-call on a job that has since ended.
async fn a_vanished_worker_after_a_cancel(store: &Store) {
    let (job_id, vanished) = started(store, "vanished").await;
    store
        .jobs()
        .cancel(job_id, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap()
        .unwrap();
    sqlx::query("UPDATE attempts SET deadline_at = now() - interval '1 hour' WHERE id = $1")
        .bind(vanished.attempt_id.0)
        .execute(store.pool())
        .await
        .unwrap();
    assert!(
        store
            .sweeps()
            .expire_vanished(Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    let job = store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded);
}

/// Messages in `queue`, ready or delivered but not yet acked (rabbitmqctl sees
/// both; a passive declare sees only the ready ones).
fn queue_total(vhost: &str, queue: &str) -> Option<u64> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "-p", vhost, "name", "messages"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let mut cols = l.split_whitespace();
        (cols.next() == Some(queue)).then(|| cols.next()?.parse().ok())?
    })
}

/// Item 6: a hedge queued behind a primary that went `unknown` used to have its
/// delivery acked as a "duplicate", and once the operator resolved the primary the
/// job stayed blocked with nothing left to resolve. Now the settlement that lifts
/// the block publishes the hedge again, and the job proceeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hedge_turned_away_by_an_unknown_runs_once_the_unknown_is_resolved() {
    let fallback = mock(MockOptions {
        tag: Some("fallback".into()),
        ..MockOptions::default()
    })
    .await;
    let (config, file) = config(&config_text(
        "http://127.0.0.1:9/v1",
        Some(&fallback.base_url()),
        "",
    ));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job_id, _) = env.admit(&ctx, "acct_z", "zombie", "zombie").await;
    let (jobs, settle) = (env.store.jobs(), env.store.settle());
    let first = jobs.job(job_id).await.unwrap().unwrap().attempts[0].id;
    let started = settle
        .start("primary", &[first], Duration::from_secs(30))
        .await;
    let primary = started.unwrap().remove(0);
    let hedge = env.store.sweeps().hedge(job_id, "fallback").await;
    let hedge = hedge.unwrap().unwrap();
    // The hedge takes its turn: handed out, its message goes to the queue.
    assert_eq!(env.hand_out(&ctx, "fallback").await, 1);
    let timed_out = [timed_out(&primary)];
    let (settled, _) = settle.finalize(&timed_out, &common::give_up).await.unwrap();
    assert_eq!(settled, vec![Settled::Unknown]);

    // The hedge's delivery arrives while the job is blocked, and is settled.
    let fleet = env
        .fleet(
            config.clone(),
            vec![onejob::fleet::Role::Attempts("fallback".into())],
        )
        .await;
    let queue = onejob::broker::attempts_queue("fallback");
    wait_for(
        "the hedge's delivery to be settled",
        Duration::from_secs(20),
        || async { (queue_total(&env.name, &queue) == Some(0)).then_some(()) },
    )
    .await;
    assert_eq!(
        fallback.stats.requests(),
        0,
        "nothing runs beside an unknown"
    );
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown);

    // The operator resolves the primary as failed: the hedge runs and wins.
    env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &primary.attempt_id.to_string(),
            "--as",
            "failed",
        ],
    );
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.completed_by, Some(hedge));
    assert_eq!(fallback.stats.requests(), 1);
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}
