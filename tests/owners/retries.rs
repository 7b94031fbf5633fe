//! Retries and hedges take a reservation of their own before they start
//! (contract section 7, Owners): a retry whose reservation does not fit in
//! what the owner's budget leaves never starts, and its job fails
//! `budget_exceeded`; one that fits runs; a hedge that does not fit never
//! starts, and its job carries on with the attempt it hedged.

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::{Misbehaviour, MockHandle, MockOptions};
use onejob_producer::Producer;

use crate::common::{self, P, TestEnv, config, config_for, mock, submit, wait_for_status};

/// A primary whose every answer breaks the output contract (a failure that
/// still reports usage, so its cost stays spent), and a qualified fallback:
/// the owner's first attempt fails on the primary and its retry would run on
/// the fallback. The owner's budget is `budgets` reservations of one job;
/// the job's end, and the requests each provider got.
async fn retried_under(budgets: i64) -> (onejob::edges::store::JobView, u64, u64, i64) {
    let primary = mock(MockOptions {
        misbehave: Some(Misbehaviour::Prose),
        ..MockOptions::default()
    })
    .await;
    let fallback = mock(MockOptions::default()).await;
    let text = config_for(
        &[
            P("primary", &primary.base_url(), ""),
            P("fallback", &fallback.base_url(), ""),
        ],
        "",
    );
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    env.cli_ok(&file.path, &["providers", "qualify", "fallback"]);
    let qualifying = fallback.stats.requests();
    let one = common::intent("acct_retry", "k", "retry me");
    let reserve = onejob::shared::runtime::new_job(&config, &serde_json::to_vec(&one).unwrap())
        .unwrap()
        .reserve;
    let budget = (budgets * reserve).to_string();
    env.cli_ok(
        &file.path,
        &[
            "owners",
            "set",
            "acct_retry",
            "--daily-tokens",
            &budget,
            "--reason",
            "test",
        ],
    );
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_retry", "k", "retry me").await;
    let status = if budgets >= 2 {
        JobStatus::Succeeded
    } else {
        JobStatus::Failed
    };
    let job = wait_for_status(&env, job_id, status).await;
    let owner = env.store.owners().owner("acct_retry").await.unwrap();
    assert_eq!(
        owner.reserved, 0,
        "nothing stays reserved once the job ended"
    );
    producer.close().await;
    fleet.stop().await;
    let calls = |m: &MockHandle| m.stats.requests();
    (
        job,
        calls(&primary),
        calls(&fallback) - qualifying,
        owner.spent_24h,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_whose_reservation_does_not_fit_never_starts() {
    let (job, primary, fallback, spent) = retried_under(1).await;
    let error = job.error.clone().unwrap_or_default();
    assert!(error.starts_with("budget_exceeded:"), "{error} {job:?}");
    assert_eq!((primary, fallback), (1, 0), "the retry was never sent");
    let retry = job.attempts.iter().find(|a| a.number == 2).unwrap();
    assert_eq!(retry.status, AttemptStatus::Failed);
    assert!(spent > 0, "the failed answer's usage is spent: {spent}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_whose_reservation_fits_runs() {
    let (job, primary, fallback, spent) = retried_under(2).await;
    assert_eq!((primary, fallback), (1, 1), "{job:?}");
    assert_eq!(job.attempts.len(), 2);
    assert!(spent > 0);
}

/// A hedge reserves before it starts too. With room for one job's
/// reservation, the owner's hedge does not fit: it fails `budget_exceeded`
/// before its call, and the job carries on with the attempt it hedged (whose
/// call may already be paid for), which wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hedge_whose_reservation_does_not_fit_never_starts() {
    let primary = mock(MockOptions {
        delay: std::time::Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let fallback = mock(MockOptions::default()).await;
    let (config, file) = config(&common::hedged_config(
        &primary.base_url(),
        &fallback.base_url(),
    ));
    let env = TestEnv::new(&config).await;
    env.cli_ok(&file.path, &["providers", "qualify", "fallback"]);
    let qualifying = fallback.stats.requests();
    let one = common::intent("acct_hedge", "k", "hedge me");
    let reserve = onejob::shared::runtime::new_job(&config, &serde_json::to_vec(&one).unwrap())
        .unwrap()
        .reserve;
    env.cli_ok(
        &file.path,
        &[
            "owners",
            "set",
            "acct_hedge",
            "--daily-tokens",
            &reserve.to_string(),
            "--reason",
            "test",
        ],
    );
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_hedge", "k", "hedge me").await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    producer.close().await;
    fleet.stop().await;
    assert_eq!(
        fallback.stats.requests() - qualifying,
        0,
        "the hedge was never sent"
    );
    let hedge = job
        .attempts
        .iter()
        .find(|a| a.provider == "fallback")
        .unwrap();
    assert_eq!(hedge.status, AttemptStatus::Failed);
    let error = hedge.error.clone().unwrap_or_default();
    assert!(error.starts_with("budget_exceeded:"), "{error}");
    let winner = job
        .attempts
        .iter()
        .find(|a| Some(a.id) == job.completed_by)
        .unwrap();
    assert_eq!(winner.provider, "primary");
}
