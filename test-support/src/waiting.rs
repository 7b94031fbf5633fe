//! Waiting for the system to get somewhere: a condition, a job's status, the
//! reconciler's whole sweeps, and the events once nothing is left to publish.

use std::future::Future;
use std::time::{Duration, Instant};

use onejob::edges::store::Store;

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

/// Inserts an outbox row published a century ago: the reconciler's next outbox
/// pruning deletes it whatever the retention. Its id.
async fn sweep_marker(store: &Store) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, not_before, published_at)
         VALUES ('onejob.events', 'test.sweep-marker', 'sweep-marker', '{}',
                 now() - interval '100 years', now() - interval '100 years')
         RETURNING id",
    )
    .fetch_one(store.pool())
    .await
    .expect("insert a sweep marker")
}

async fn marker_pruned(store: &Store, id: i64) -> bool {
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE id = $1")
        .bind(id)
        .fetch_one(store.pool())
        .await
        .expect("look for the sweep marker");
    left == 0
}

/// Runs `check` over and over (every 50 ms, and once more at the end) until at
/// least `at_least` has passed and the reconciler has made `passes` whole
/// sweeps that began after this call: a window shown to have covered the
/// sweeps' chances to act (vanished workers, lost messages, hedging, the
/// relay). A sweep is seen through a later step of the same pass: the outbox
/// pruning that follows it deletes a marker row published a century ago. Marker
/// `k + 1` is inserted once marker `k` is gone, so the pass that prunes it began
/// its sweep after marker `k` was gone; the first marker's pass may have begun
/// before the call, and is not counted. Panics naming `what` if the sweeps do
/// not come (no reconciler runs).
pub async fn through_sweeps<F, Fut>(
    store: &Store,
    passes: usize,
    at_least: Duration,
    what: &str,
    mut check: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let start = Instant::now();
    let limit = at_least + Duration::from_secs(30) + Duration::from_secs(5) * passes as u32;
    let mut marker = sweep_marker(store).await;
    let mut pruned = 0;
    loop {
        check().await;
        if pruned <= passes && marker_pruned(store, marker).await {
            pruned += 1;
            if pruned <= passes {
                marker = sweep_marker(store).await;
            }
        }
        if pruned > passes && start.elapsed() >= at_least {
            check().await;
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{what}: timed out after {limit:?} with {} of {passes} reconciler sweeps seen",
            pruned.saturating_sub(1)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the reconciler has made `passes` whole sweeps that began after
/// this call (see [`through_sweeps`]).
pub async fn sweeps_ran(store: &Store, passes: usize, what: &str) {
    through_sweeps(store, passes, Duration::ZERO, what, || async {}).await;
}

/// Every message `queue` (bound to the events exchange) holds once there is
/// nothing left to publish: every outbox row is published (each publish was
/// confirmed, so its copy is in the queue) and the reconciler has made two
/// more whole passes, each relaying the outbox before its sweep. A second copy
/// of an event, published again by the relay or by a redelivered settlement,
/// would be in the queue by then.
pub async fn events_once_settled(
    env: &TestEnv,
    ch: &lapin::Channel,
    queue: &str,
) -> Vec<lapin::message::Delivery> {
    let mut got = env.drain(ch, queue).await;
    wait_for(
        "every outbox row to be published",
        Duration::from_secs(20),
        || async {
            let unpublished: i64 =
                sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                    .fetch_one(env.store.pool())
                    .await
                    .expect("count unpublished outbox rows");
            (unpublished == 0).then_some(())
        },
    )
    .await;
    sweeps_ran(&env.store, 2, "the relay after the outbox was published").await;
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
