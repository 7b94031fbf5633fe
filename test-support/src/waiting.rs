//! Waiting for the system to get somewhere: a condition, a job's status, the
//! reconciler's whole sweeps, and the events once nothing is left to publish.

use std::future::Future;
use std::time::{Duration, Instant};

use onejob::edges::store::Store;
use onejob::shared::runtime::Context;

use super::TestEnv;

/// Polls `check` until it returns `Some`, or panics naming `what` after `limit`.
pub async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The reconciler's passes that could start, republish, hedge or settle
/// something: each run of one is a chance for that to happen.
pub const SWEEPS: [&str; 6] = ["relay", "vanished", "kept", "lost", "unserved", "hedge"];

/// Runs `check` over and over (every 50 ms, and once more at the end) until at
/// least `at_least` has passed and each of the reconciler's [`SWEEPS`] in
/// `fleet` has made `runs` whole runs that began after this call: a window
/// shown to have covered the sweeps' chances to act (vanished workers, lost
/// messages, hedging, the relay). Panics naming `what` if the runs do not come
/// (no reconciler runs).
pub async fn through_sweeps<F, Fut>(
    fleet: &Context,
    runs: u64,
    at_least: Duration,
    what: &str,
    mut check: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let start = Instant::now();
    let limit = at_least + Duration::from_secs(30) + Duration::from_secs(5) * runs as u32;
    let since = fleet.pass_runs.counts();
    let swept = fleet.pass_runs.wait(&since, &SWEEPS, runs);
    tokio::pin!(swept);
    let mut done = false;
    loop {
        check().await;
        if done && start.elapsed() >= at_least {
            check().await;
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{what}: timed out after {limit:?} waiting for {runs} runs of each of {SWEEPS:?} (ran since: {:?})",
            fleet.pass_runs.counts()
        );
        tokio::select! {
            () = &mut swept, if !done => done = true,
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}

/// Waits until each of the reconciler's [`SWEEPS`] in `fleet` has made `runs`
/// whole runs that began after this call (see [`through_sweeps`]).
pub async fn sweeps_ran(fleet: &Context, runs: u64, what: &str) {
    through_sweeps(fleet, runs, Duration::ZERO, what, || async {}).await;
}

/// Waits until every outbox row is marked published.
pub async fn all_published(store: &Store) {
    wait_for(
        "every outbox row to be published",
        Duration::from_secs(20),
        || async {
            let unpublished: i64 =
                sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                    .fetch_one(store.pool())
                    .await
                    .expect("count unpublished outbox rows");
            (unpublished == 0).then_some(())
        },
    )
    .await;
}

/// Every message `queue` (bound to the events exchange) holds once there is
/// nothing left to publish: every outbox row is published (each publish was
/// confirmed, so its copy is in the queue) and each of the reconciler's
/// [`SWEEPS`] in `fleet` has made two more whole runs. A second copy
/// of an event, published again by the relay or by a redelivered settlement,
/// would be in the queue by then.
pub async fn events_once_settled(
    env: &TestEnv,
    fleet: &Context,
    ch: &lapin::Channel,
    queue: &str,
) -> Vec<lapin::message::Delivery> {
    let mut got = env.drain(ch, queue).await;
    all_published(&env.store).await;
    sweeps_ran(fleet, 2, "the relay after the outbox was published").await;
    got.extend(env.drain(ch, queue).await);
    got
}

/// Waits until the job reaches `status`, and returns it.
pub async fn wait_for_status(
    env: &TestEnv,
    job_id: onejob::domain::JobId,
    status: onejob::domain::JobStatus,
) -> onejob::edges::store::JobView {
    wait_for(
        &format!("job {job_id} to be {status}"),
        Duration::from_secs(20),
        || async {
            env.store
                .jobs()
                .job(job_id)
                .await
                .expect("read job")
                .filter(|j| j.status == status)
        },
    )
    .await
}

/// Waits until one of the job's attempts is `status`, and returns the job.
pub async fn wait_for_attempt(
    env: &TestEnv,
    job_id: onejob::domain::JobId,
    status: onejob::domain::AttemptStatus,
) -> onejob::edges::store::JobView {
    wait_for(
        &format!("an attempt of job {job_id} to be {status}"),
        Duration::from_secs(20),
        || async {
            let j = env.store.jobs().job(job_id).await.expect("read job")?;
            j.attempts.iter().any(|a| a.status == status).then_some(j)
        },
    )
    .await
}
