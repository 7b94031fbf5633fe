//! The owners benchmark's last step: how soon an owner over its budget is
//! refused, when what crossed the budget was a discarded answer's spend.

use std::time::Duration;

use chrono::{DateTime, Utc};
use onejob::domain::{AttemptStatus, JobId, JobStatus};
use onejob::intent::Outcome;
use onejob::store::{Actor, OwnerChange};
use onejob_producer::Producer;

use crate::common::{TestEnv, intent};

/// How often a probe intent is sent while waiting for the refusal.
const PROBE_EVERY: Duration = Duration::from_millis(10);

/// Owner C: one job to learn what a call costs; a budget of two calls less a
/// token; a job cancelled while its call is in flight, whose answer is then
/// discarded and whose spend crosses the budget; and probe intents every
/// [`PROBE_EVERY`] until one is refused. Reports how many probes were admitted
/// after the crossing settlement, and how long after it the first refusal came.
pub(crate) async fn budget(env: &TestEnv, producer: &Producer) {
    let actor = Actor::cli(Some("bench"));
    let first = created(producer, "c-0").await;
    let each = tokens(&wait_for(env, first, |j| j.status == JobStatus::Succeeded).await);
    let budget = 2 * each - 1;
    let change = OwnerChange {
        daily_tokens: Some(Some(budget)),
        ..OwnerChange::default()
    };
    env.store
        .set_owner("acct_c", &change, &actor)
        .await
        .expect("set the budget");
    let cancelled = created(producer, "c-1").await;
    wait_for(env, cancelled, |j| {
        j.attempts
            .first()
            .is_some_and(|a| a.status == AttemptStatus::Started)
    })
    .await;
    env.store
        .cancel_job(cancelled, &actor)
        .await
        .expect("cancel")
        .expect("cancellable");
    let mut probes: Vec<Option<JobId>> = Vec::new();
    loop {
        let r = producer
            .submit(&intent("acct_c", &format!("probe-{}", probes.len()), "c"))
            .await
            .expect("probe");
        if r.outcome == Outcome::Rejected {
            break;
        }
        probes.push(r.job_id);
        tokio::time::sleep(PROBE_EVERY).await;
    }
    let refused_at = Utc::now();
    let job = wait_for(env, cancelled, |j| {
        j.attempts
            .first()
            .is_some_and(|a| a.status == AttemptStatus::Discarded)
    })
    .await;
    let discarded = &job.attempts[0];
    let crossed: DateTime<Utc> = discarded.finished_at.expect("finished");
    let mut after = 0;
    for id in probes.iter().flatten() {
        let j = env.store.job(*id).await.expect("read").expect("probe job");
        if j.created_at > crossed {
            after += 1;
        }
    }
    println!(
        "budget: a call costs {each} tokens, the budget is {budget}; the cancelled job's discarded answer ({} tokens) crossed it",
        tokens(&job)
    );
    println!(
        "budget: {} probes admitted before the crossing settlement, {after} after it (goal: 0); the refusal seen {:.0} ms after it (probes every {} ms, each waiting for its receipt)",
        probes.len() - after,
        (refused_at - crossed).num_microseconds().unwrap_or(0) as f64 / 1000.0,
        PROBE_EVERY.as_millis()
    );
}

/// Publishes one of C's intents; its job, created.
async fn created(producer: &Producer, key: &str) -> JobId {
    let r = producer
        .submit(&intent("acct_c", key, "c"))
        .await
        .expect("C's intent");
    assert_eq!(r.outcome, Outcome::Created, "{r:?}");
    r.job_id.expect("job")
}

/// What the job's first attempt reported it spent.
fn tokens(job: &onejob::store::JobView) -> i64 {
    job.attempts[0]
        .usage
        .as_ref()
        .and_then(|u| u["total_tokens"].as_i64())
        .expect("the mock reports usage")
}

/// Polls the job until `done` holds.
async fn wait_for(
    env: &TestEnv,
    job: JobId,
    done: impl Fn(&onejob::store::JobView) -> bool,
) -> onejob::store::JobView {
    loop {
        let j = env.store.job(job).await.expect("read job").expect("job");
        if done(&j) {
            return j;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
