//! Retries and hedges take their turn like first attempts (issue 40, item
//! 5): the attempt a failure or the hedge sweep creates is held in Postgres
//! behind its owner's turns already waiting on its provider, and handed out
//! by the provider's hand-out under the owner's share and `max_in_flight`;
//! it never goes straight to the provider's queue ahead of other owners'
//! first attempts. A turn counts once in its owner's flight.

use onejob::policy::next::NextStep;
use std::time::Duration;

use onejob::domain::AttemptId;
use onejob::edges::store::{Finished, Resolution, Settled, Store, Verdict};

use crate::common::{self, TestEnv, config};

/// Two call slots on each provider: a share of one.
fn two_slots(fallback: bool) -> String {
    let fallback = fallback.then_some("http://127.0.0.1:9/v1");
    common::config_text("http://127.0.0.1:9/v1", fallback, "")
        .replace("concurrency = 8", "concurrency = 2")
}

/// Whether `attempt`'s turn is held (`Some(true)`), handed out
/// (`Some(false)`), or it has none.
async fn turn(store: &Store, attempt: AttemptId) -> Option<bool> {
    sqlx::query_scalar("SELECT handed_out_at IS NULL FROM turns WHERE attempt_id = $1")
        .bind(attempt.0)
        .fetch_optional(store.pool())
        .await
        .unwrap()
}

/// The message ids the hand-out on `provider` publishes now.
async fn handed_out(store: &Store, provider: &str) -> Vec<String> {
    let out = store.turns().hand_out_turns(provider, 1, "").await.unwrap();
    out.publish.into_iter().map(|m| m.message_id).collect()
}

fn failed(s: &onejob::edges::store::Started) -> Finished {
    common::database::finished(
        s,
        Verdict::Failed {
            error: "provider_error: HTTP 500".into(),
            retryable: true,
            retry_after: None,
        },
    )
}

fn retry_on(
    provider: &'static str,
) -> impl Fn(&onejob::policy::next::FailedJob) -> NextStep + Sync {
    move |_| NextStep::Retry {
        provider: provider.into(),
        delay: Duration::ZERO,
    }
}

/// Starts `attempt` on the primary and fails it, retryable: the retry the
/// settlement made, and what the settlement gave to publish.
async fn failed_into_a_retry(
    store: &Store,
    attempt: AttemptId,
) -> (AttemptId, Vec<onejob::edges::store::OutboxMessage>) {
    let first = store
        .settle()
        .start("primary", &[attempt], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    let (settled, publish) = store
        .settle()
        .finalize(&[failed(&first)], &retry_on("primary"))
        .await
        .unwrap();
    let Settled::Failed {
        next: Some(retry), ..
    } = settled[0]
    else {
        panic!("a retry: {settled:?}");
    };
    (retry, publish)
}

/// An owner's first job fails while its second waits its turn: the retry is
/// held behind the second (it went straight to the provider's queue before,
/// seen failing), and each is handed out as the one before it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_waits_behind_its_owners_held_turns() {
    let (config, _file) = config(&two_slots(false));
    let env = TestEnv::new(&config).await;
    let batch: Vec<_> = (0..2)
        .map(|i| common::new_job("acct_r", &format!("r-{i}"), "x"))
        .collect();
    super::created(&env.store, &batch).await;
    assert_eq!(turn(&env.store, batch[1].attempt_id).await, Some(true));
    let (retry, publish) = failed_into_a_retry(&env.store, batch[0].attempt_id).await;
    assert!(
        publish.iter().all(|m| m.message_id != retry.to_string()),
        "the retry went straight to the provider's queue"
    );
    assert_eq!(
        turn(&env.store, retry).await,
        Some(true),
        "its turn is held"
    );
    assert_eq!(
        handed_out(&env.store, "primary").await,
        [batch[1].attempt_id.to_string()],
        "the owner's turn taken first goes first"
    );
    assert!(
        handed_out(&env.store, "primary").await.is_empty(),
        "a share of one"
    );
    env.store
        .settle()
        .start("primary", &[batch[1].attempt_id], Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(handed_out(&env.store, "primary").await, [retry.to_string()]);
    assert_eq!(turn(&env.store, retry).await, Some(false));
    let started = env
        .store
        .settle()
        .start("primary", &[retry], Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(started.len(), 1, "the retry starts");
    assert_eq!(turn(&env.store, retry).await, None, "its turn ended");
}

/// A hedge takes a turn on its provider, handed out by that provider's
/// hand-out (the hedge sweep published it at once before, seen failing);
/// handed out, it counts once in its owner's flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hedge_takes_its_turn_and_counts_once_in_flight() {
    let (config, _file) = config(&two_slots(true));
    let env = TestEnv::new(&config).await;
    let new = common::new_job("acct_h", "h", "x");
    let (job, first) = (new.job_id, new.attempt_id);
    super::created(&env.store, &[new]).await;
    env.store
        .settle()
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap();
    let hedge = env
        .store
        .sweeps()
        .hedge(job, "fallback")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        turn(&env.store, hedge).await,
        Some(true),
        "the hedge went straight to the queue"
    );
    let in_flight = || async {
        sqlx::query_scalar::<_, i64>("SELECT owner_in_flight('acct_h')")
            .fetch_one(env.store.pool())
            .await
            .unwrap()
    };
    assert_eq!(in_flight().await, 1, "a held hedge is not in flight");
    assert_eq!(
        handed_out(&env.store, "fallback").await,
        [hedge.to_string()]
    );
    assert_eq!(in_flight().await, 2, "the hedge handed out counts once");
}

/// A hedge held while its job is blocked by the unknown it hedged: lifting
/// the block leaves the held hedge to its hand-out, and publishes nothing
/// for it (a second message would pass its owner's turn).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lifted_block_leaves_a_held_hedge_to_its_turn() {
    let (config, _file) = config(&two_slots(true));
    let env = TestEnv::new(&config).await;
    let new = common::new_job("acct_b", "b", "x");
    let (job, first) = (new.job_id, new.attempt_id);
    super::created(&env.store, &[new]).await;
    let primary = env
        .store
        .settle()
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    let hedge = env
        .store
        .sweeps()
        .hedge(job, "fallback")
        .await
        .unwrap()
        .unwrap();
    let mut timed_out = failed(&primary);
    timed_out.verdict = Verdict::Unknown {
        error: "timeout: no answer".into(),
    };
    let (settled, _) = env
        .store
        .settle()
        .finalize(&[timed_out], &common::give_up)
        .await
        .unwrap();
    assert_eq!(settled, [Settled::Unknown]);
    let actor = onejob::edges::store::Actor {
        name: "cli:test".into(),
        reason: "test".into(),
    };
    let (_, publish) = env
        .store
        .settle()
        .resolve(first, Resolution::Failed, &common::give_up, &actor)
        .await
        .unwrap()
        .unwrap();
    assert!(
        publish.iter().all(|m| m.message_id != hedge.to_string()),
        "the held hedge was published past its turn"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE message_id = $1")
        .bind(hedge.to_string())
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1, "one message for the hedge, its turn's");
    assert_eq!(
        handed_out(&env.store, "fallback").await,
        [hedge.to_string()]
    );
}

/// A worker stopped between reserving for a retry and claiming it again
/// (the retry holds its reservation, still `queued`; its message goes back
/// to the queue): the worker that takes the message next claims it at once,
/// and the retry holds one reservation, not two, released when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_stopped_between_reserving_and_claiming_reserves_once() {
    let text = two_slots(false) + "\n[owners]\ndaily_tokens = 100000\n";
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let new = common::new_job("acct_s", "s-1", "x");
    super::created(&env.store, std::slice::from_ref(&new)).await;
    let (retry, _) = failed_into_a_retry(&env.store, new.attempt_id).await;
    assert_eq!(handed_out(&env.store, "primary").await, [retry.to_string()]);
    // The stopping worker's claim leaves the retry to reserve, and it does...
    let timeout = Duration::from_secs(30);
    let first_claim = env
        .store
        .settle()
        .claim("primary", "none", &[retry], timeout, uuid::Uuid::new_v4())
        .await
        .unwrap();
    assert!(first_claim.started.is_empty());
    let [unreserved] = &first_claim.unreserved[..] else {
        panic!("the retry holds no reservation: {first_claim:?}");
    };
    let wanted = onejob::edges::store::Reservation {
        attempt_id: retry,
        owner_id: unreserved.owner_id.clone(),
        tokens: 40,
    };
    let refused = env
        .store
        .owners()
        .reserve(std::slice::from_ref(&wanted))
        .await
        .unwrap();
    assert!(refused.is_empty(), "{refused:?}");
    // ...then stops before its second claim. The next worker's claim starts
    // it, and weighs nothing again: the same reservation, once.
    let next = env
        .store
        .settle()
        .claim("primary", "none", &[retry], timeout, uuid::Uuid::new_v4())
        .await
        .unwrap();
    assert_eq!(next.started.len(), 1, "{next:?}");
    assert!(next.unreserved.is_empty(), "{next:?}");
    assert_eq!(
        env.store.owners().reserve(&[wanted]).await.unwrap().len(),
        0
    );
    let held: (i64, i64) = sqlx::query_as(
        "SELECT count(*), COALESCE(sum(tokens), 0)::int8 FROM reservations WHERE attempt_id = $1",
    )
    .bind(retry.0)
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert_eq!(held, (1, 40), "one reservation");
    assert_eq!(
        env.store.owners().owner("acct_s").await.unwrap().reserved,
        40
    );
    // Its ending releases it.
    let started = &next.started[0];
    env.store
        .settle()
        .finalize(&[failed(started)], &common::give_up)
        .await
        .unwrap();
    assert_eq!(
        env.store.owners().owner("acct_s").await.unwrap().reserved,
        0
    );
}
