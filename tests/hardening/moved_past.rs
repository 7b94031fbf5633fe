//! The stuck sweep on a provider whose queue never empties (issue 40): a
//! message lost from it (a purge, a dead-letter) while other owners'
//! messages keep it busy.

use std::time::Duration;

use onejob::domain::{AttemptId, JobId};

use crate::common::{TestEnv, config, config_text};

/// Issue 40: the stuck sweep skipped every provider whose queue held
/// messages, so an attempt whose message was lost from a queue that other
/// owners kept busy stayed `queued` for ever, and its handed-out turn kept
/// its owner's place (seen failing: nothing was republished). Now, on such a
/// provider, the sweep republishes an attempt the queue has moved past (an
/// attempt whose message was published over a second after its own has
/// started), and still leaves alone those the queue has not reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_stuck_sweep_republishes_what_a_busy_queue_has_moved_past() {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    // Four owners' first attempts on one provider, published in this order,
    // a minute apart, the first ten minutes ago.
    let mut jobs = Vec::new();
    for (minutes_ago, name) in [(10, "lost"), (9, "passed"), (8, "waiting"), (7, "behind")] {
        let (job, publish) = env.admit(&ctx, &format!("acct_{name}"), name, name).await;
        ctx.publish_outbox(&[publish]).await.unwrap();
        let attempt = attempt_of(&env, job).await;
        sent(&env, attempt, minutes_ago).await;
        jobs.push((job, attempt));
    }
    let [
        (_, lost),
        (_, passed),
        (waiting_job, waiting),
        (behind_job, behind),
    ] = jobs[..]
    else {
        unreachable!()
    };
    // `passed` was delivered and started: the queue moved past `lost`,
    // whose message is gone. `waiting` and `behind` are still in the queue.
    env.store
        .settle()
        .start("primary", &[passed], Duration::from_secs(30))
        .await
        .unwrap();
    let backlogged = ["primary".to_owned()];
    let (republish, exhausted) = env
        .store
        .sweeps()
        .stuck_queued(Duration::from_secs(60), 3, &backlogged)
        .await
        .unwrap();
    let ids: Vec<&str> = republish.iter().map(|m| m.message_id.as_str()).collect();
    assert_eq!(ids, [lost.to_string()], "only what the queue moved past");
    assert!(exhausted.is_empty());
    for (job, n) in [(waiting_job, 0), (behind_job, 0)] {
        assert_eq!(republished(&env, job).await, n, "left in the backlog");
    }
    let _ = (waiting, behind);
    // Republished now, `lost` is not stuck again until `stuck_after` has passed.
    let (again, _) = env
        .store
        .sweeps()
        .stuck_queued(Duration::from_secs(60), 3, &backlogged)
        .await
        .unwrap();
    assert!(again.is_empty(), "{again:?}");
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// A turn held past `stuck_after` and handed out just now is not stuck: the
/// wait is counted from its message's last publish, not from when its
/// attempt was queued (it was republished at the first sweep after its
/// hand-out, seen failing, each time one more step towards `attempt_lost`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_handed_out_after_a_long_hold_is_not_stuck_at_once() {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job, publish) = env.admit(&ctx, "acct_held", "held", "held").await;
    ctx.publish_outbox(&[publish]).await.unwrap();
    let attempt = attempt_of(&env, job).await;
    // Queued ten minutes ago (its turn was held), published just now.
    sent(&env, attempt, 0).await;
    sqlx::query("UPDATE attempts SET not_before = now() - interval '10 minutes' WHERE id = $1")
        .bind(attempt.0)
        .execute(env.store.pool())
        .await
        .unwrap();
    let (republish, _) = env
        .store
        .sweeps()
        .stuck_queued(Duration::from_secs(60), 3, &[])
        .await
        .unwrap();
    assert!(republish.is_empty(), "{republish:?}");
    // Once its message has waited `stuck_after`, it is.
    sent(&env, attempt, 2).await;
    let (republish, _) = env
        .store
        .sweeps()
        .stuck_queued(Duration::from_secs(60), 3, &[])
        .await
        .unwrap();
    assert_eq!(republish.len(), 1, "{republish:?}");
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// An attempt handed back by a claim cut off at a stop is `queued` with no
/// turn (its turn ended when it started): the sweep reads the handed-out
/// turns and, for these, the running jobs' turnless attempts, so its message
/// lost is still sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_handed_back_by_a_claim_is_still_swept() {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job, publish) = env.admit(&ctx, "acct_back", "back", "back").await;
    ctx.publish_outbox(&[publish]).await.unwrap();
    let attempt = attempt_of(&env, job).await;
    let token = uuid::Uuid::new_v4();
    env.store
        .settle()
        .claim(
            "primary",
            "none",
            &[attempt],
            Duration::from_secs(30),
            token,
        )
        .await
        .unwrap();
    assert_eq!(env.store.settle().unclaim(token).await.unwrap(), 1);
    let turns: i64 = sqlx::query_scalar("SELECT count(*) FROM turns WHERE attempt_id = $1")
        .bind(attempt.0)
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(turns, 0, "its turn ended when it started");
    sent(&env, attempt, 5).await;
    let (republish, _) = env
        .store
        .sweeps()
        .stuck_queued(Duration::from_secs(60), 3, &[])
        .await
        .unwrap();
    let ids: Vec<&str> = republish.iter().map(|m| m.message_id.as_str()).collect();
    assert_eq!(ids, [attempt.to_string()]);
    let _ = ctx.connection.close(200, "done".into()).await;
}

async fn attempt_of(env: &TestEnv, job: JobId) -> AttemptId {
    env.store.jobs().job(job).await.unwrap().unwrap().attempts[0].id
}

/// Dates `attempt`'s message as published, and its attempt as queued,
/// `minutes_ago`.
async fn sent(env: &TestEnv, attempt: AttemptId, minutes_ago: i32) {
    let pool = env.store.pool();
    sqlx::query(
        "UPDATE outbox SET published_at = now() - make_interval(mins => $2)
         WHERE message_id = $1::text",
    )
    .bind(attempt.0)
    .bind(minutes_ago)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("UPDATE attempts SET not_before = now() - make_interval(mins => $2) WHERE id = $1")
        .bind(attempt.0)
        .bind(minutes_ago)
        .execute(pool)
        .await
        .unwrap();
}

async fn republished(env: &TestEnv, job: JobId) -> i32 {
    sqlx::query_scalar("SELECT republished FROM attempts WHERE job_id = $1")
        .bind(job.0)
        .fetch_one(env.store.pool())
        .await
        .unwrap()
}
