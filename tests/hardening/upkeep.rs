//! The reconciler's upkeep: published outbox rows pruned, the stuck sweep
//! leaving a backlog alone, statistics kept current on a fresh database.

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobId};

use crate::common::{self, TestEnv, config, config_text, wait_for};

/// Item 15: published outbox rows are pruned after `outbox_retention`; rows not
/// yet published, and recent ones, stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn published_outbox_rows_are_pruned() {
    let text = config_text("http://127.0.0.1:9/v1", None, "")
        .replace("[worker]\n", "[worker]\noutbox_retention = \"1m\"\n");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let pool = env.store.pool();
    let ids: Vec<(i64,)> = sqlx::query_as(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, published_at, not_before)
         VALUES ('onejob.events', 'job.succeeded', 'old', '{}', now() - interval '2 hours', now() + interval '1 day'),
                ('onejob.events', 'job.succeeded', 'recent', '{}', now() - interval '10 seconds', now() + interval '1 day'),
                ('onejob.events', 'job.succeeded', 'pending', '{}', NULL, now() + interval '1 day')
         RETURNING id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(ids.len(), 3);
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Reconciler])
        .await;
    let left: Vec<String> = wait_for(
        "the old row to be pruned",
        Duration::from_secs(20),
        || async {
            let left: Vec<(String,)> = sqlx::query_as("SELECT message_id FROM outbox ORDER BY id")
                .fetch_all(pool)
                .await
                .unwrap();
            let left: Vec<String> = left.into_iter().map(|(m,)| m).collect();
            (!left.contains(&"old".to_owned())).then_some(left)
        },
    )
    .await;
    assert_eq!(left, vec!["recent".to_owned(), "pending".to_owned()]);
    fleet.stop().await;
}

/// Item 15: an attempt that has not started because its message waits behind a
/// backlog is not republished, nor failed as lost, while its queue holds messages.
/// Beside it, a control attempt on another provider whose message was lost
/// (its queue is empty) is stuck for as long: the sweep that republishes the
/// control, and the one after that fails it, each had the backlogged attempt
/// in the same statement, and left it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_stuck_sweep_leaves_attempts_waiting_in_a_backlog() {
    // One attempt per job, so that the failed control leaves nothing behind it.
    let text = config_text("http://127.0.0.1:9/v1", Some("http://127.0.0.1:9/v1"), "")
        .replace(
            "[worker]\n",
            "[worker]\nstuck_after = \"200ms\"\nmax_republish = 1\n",
        )
        .replace("max_attempts = 3", "max_attempts = 1");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let (job_id, publish) = env.admit(&ctx, "acct_b", "backlog", "backlog").await;
    // The control, admitted after it (so stuck no sooner), pinned to the fallback.
    let (control, control_publish) = admitted_to_the_fallback(&env, &ctx).await;
    // Its message is in the queue, behind nothing, with no consumer: a backlog.
    // The control's message is published, then lost (taken off its queue).
    ctx.publish_outbox(&[publish, control_publish])
        .await
        .unwrap();
    let ch = ctx.connection.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    let fallback_queue = onejob::broker::attempts_queue("fallback");
    assert_eq!(env.drain(&ch, &fallback_queue).await.len(), 1);
    let republished = |job| republished(&env.store, job);
    let left_alone = || left_alone(&env, &ch, &queue, job_id);

    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Reconciler])
        .await;
    // The first sweep to find the control stuck republishes it...
    wait_for(
        "the control to be republished",
        Duration::from_secs(20),
        || async {
            left_alone().await;
            (republished(control).await == 1).then_some(())
        },
    )
    .await;
    left_alone().await;
    // ...and, its message lost again, a later one fails it as lost.
    common::wait_for_messages(&env, &ch, &fallback_queue).await;
    let failed = wait_for(
        "the control to be failed as lost",
        Duration::from_secs(20),
        || async {
            left_alone().await;
            let job = env.store.jobs().job(control).await.unwrap().unwrap();
            (job.attempts[0].status == AttemptStatus::Failed).then_some(job)
        },
    )
    .await;
    assert!(
        failed.attempts[0]
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("attempt_lost"),
        "{failed:?}"
    );
    left_alone().await;
    fleet.stop().await;
    let _ = ctx.connection.close(200, "done".into()).await;
}

/// Admits the control of the stuck sweep's test: an intent pinned to the
/// fallback, through validation as intake admits it.
async fn admitted_to_the_fallback(
    env: &TestEnv,
    ctx: &onejob::shared::runtime::Context,
) -> (JobId, onejob::edges::store::OutboxMessage) {
    let mut pinned = common::intent("acct_b", "lost", "lost");
    pinned.provider = Some("fallback".into());
    let body = serde_json::to_vec(&pinned).unwrap();
    let new = onejob::roles::intake::validate(ctx, &body).expect("valid intent");
    let control = new.job_id;
    match env.store.admission().admit(&[new]).await.unwrap().remove(0) {
        onejob::edges::store::Admission::Created {
            publish: Some(publish),
            ..
        } => (control, publish),
        other => panic!("expected created, got {other:?}"),
    }
}

/// How many times `job`'s attempt was republished.
async fn republished(store: &onejob::edges::store::Store, job: JobId) -> i32 {
    let (n,): (i32,) = sqlx::query_as("SELECT republished FROM attempts WHERE job_id = $1")
        .bind(job.0)
        .fetch_one(store.pool())
        .await
        .unwrap();
    n
}

/// The backlogged job `job_id` is left alone: one attempt, still `queued`,
/// never republished, its message the only one in `queue`.
async fn left_alone(env: &TestEnv, ch: &lapin::Channel, queue: &str, job_id: JobId) {
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts.len(), 1, "{job:?}");
    assert_eq!(job.attempts[0].status, AttemptStatus::Queued, "{job:?}");
    assert_eq!(
        republished(&env.store, job_id).await,
        0,
        "republished from the backlog"
    );
    assert_eq!(
        common::depth(ch, queue).await,
        1,
        "republished into the backlog"
    );
}

/// Issue 11: a fresh database that takes a backlog is analyzed as soon as its
/// busy tables have a thousand changed rows, not a minute later on
/// autovacuum's round; once current, the statistics are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn statistics_follow_a_fresh_database_that_fills_up() {
    let env = common::store_env().await;
    let store = &env.store;
    for chunk in 0..12 {
        let batch: Vec<_> = (0..100)
            .map(|i| common::new_job("acct_stats", &format!("k-{chunk}-{i}"), "x"))
            .collect();
        store.admission().admit(&batch).await.unwrap();
    }
    // The activity counters reach pg_stat_user_tables within seconds.
    let analyzed = wait_for(
        "jobs and attempts to be analyzed",
        Duration::from_secs(30),
        || async {
            let tables = store.sweeps().refresh_statistics().await.unwrap();
            (tables.contains(&"jobs".to_owned()) && tables.contains(&"attempts".to_owned()))
                .then_some(tables)
        },
    )
    .await;
    assert!(
        analyzed
            .iter()
            .all(|t| ["jobs", "attempts", "outbox"].contains(&t.as_str()))
    );
    let (reltuples,): (f32,) =
        sqlx::query_as("SELECT reltuples FROM pg_class WHERE relname = 'jobs'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(
        reltuples, 1200.0,
        "the planner knows how many jobs there are"
    );
    let again = store.sweeps().refresh_statistics().await.unwrap();
    assert!(
        !again.contains(&"jobs".to_owned()),
        "current statistics are left alone: {again:?}"
    );
}
