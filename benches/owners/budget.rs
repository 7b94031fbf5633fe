//! The owners benchmark's last step: whether a budget binds. Owner C, with a
//! budget of ten jobs' reservations, publishes a burst of intents at once;
//! what its calls spent is set against its budget (the overshoot, goal 0),
//! and what a job reserved against what its call spent (the estimate's
//! error, on the safe side when the reservation is larger).

use std::time::Duration;

use futures_util::future::join_all;
use onejob::domain::{JobId, JobStatus};
use onejob::edges::store::{Actor, OwnerChange};
use onejob::intent::Outcome;
use onejob_producer::Producer;

use crate::common::{TestEnv, intent};

/// The burst C publishes at once.
const BURST: usize = 200;
/// C's budget, in jobs' reservations.
const JOBS: i64 = 10;

/// Owner C: a budget of [`JOBS`] reservations and a burst of [`BURST`]
/// intents at once; then every job it was admitted runs to its end. Reports
/// how many were created and refused, what was spent against the budget,
/// and what one job reserved against what its call spent.
pub(crate) async fn budget(
    env: &TestEnv,
    producer: &Producer,
    config: &onejob::settings::config::Config,
) {
    let probe = intent("acct_c", "c-0", "c");
    let reserve =
        onejob::shared::runtime::new_job(config, &serde_json::to_vec(&probe).expect("json"))
            .expect("a valid intent")
            .reserve;
    let budget = JOBS * reserve;
    let change = OwnerChange {
        daily_tokens: Some(Some(budget)),
        ..OwnerChange::default()
    };
    env.store
        .owners()
        .set("acct_c", &change, &Actor::cli(Some("bench")))
        .await
        .expect("set the budget");
    let intents: Vec<_> = (0..BURST)
        .map(|i| intent("acct_c", &format!("c-{i}"), "c"))
        .collect();
    let receipts = join_all(intents.iter().map(|i| producer.submit(i))).await;
    let created: Vec<JobId> = receipts
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .filter(|r| r.outcome == Outcome::Created)
        .filter_map(|r| r.job_id)
        .collect();
    let refused = receipts
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .filter(|r| r.outcome == Outcome::Rejected)
        .count();
    for job in &created {
        ended(env, *job).await;
    }
    let spent = env
        .store
        .owners()
        .owner("acct_c")
        .await
        .expect("owner")
        .spent_24h;
    let each = spent as f64 / created.len().max(1) as f64;
    println!(
        "budget: {BURST} intents at once against {budget} tokens ({JOBS} reservations of {reserve}): {} created, {refused} refused; spent {spent} tokens, overshoot {} (goal: 0); a job reserved {reserve} and its call spent {each:.1} on average (the estimate's error: {:.1} tokens, on the safe side)",
        created.len(),
        (spent - budget).max(0),
        reserve as f64 - each,
    );
}

/// Polls the job until it has ended.
async fn ended(env: &TestEnv, job: JobId) {
    loop {
        let j = env
            .store
            .jobs()
            .job(job)
            .await
            .expect("read job")
            .expect("job");
        if matches!(
            j.status,
            JobStatus::Succeeded | JobStatus::Failed | JobStatus::Cancelled
        ) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
