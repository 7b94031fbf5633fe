//! Fair dispatch: an owner's backlog waits in Postgres, each first attempt
//! holding a turn, and only the owner's share of the provider's queue is
//! handed out at once; so another owner's job waits behind that share, not
//! behind the backlog.

use std::time::Duration;

use onejob::domain::JobStatus;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use crate::common::{self, TestEnv, config, mock, submit, wait_for, wait_for_status};

/// How many rows `sql` (one count, of `$1`) counts.
async fn count(env: &TestEnv, sql: &'static str, arg: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(arg)
        .fetch_one(env.store.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_holds_another_owners_job_behind_its_share_only() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(200),
        ..MockOptions::default()
    })
    .await;
    // Two call slots: a share of one.
    let text = common::config_text(&primary.base_url(), None, "")
        .replace("concurrency = 8", "concurrency = 2");
    let (config, file) = config(&text);
    assert_eq!(config.providers["primary"].share(), 1);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    // Thirty of one owner's intents at once: all created.
    let flood_jobs = super::in_flight::flood(&producer, "acct_flood", 30).await;
    let succeeded = "SELECT count(*) FROM jobs WHERE owner_id = $1 AND status = 'succeeded'";
    wait_for("the flood under way", Duration::from_secs(30), || async {
        (count(&env, succeeded, "acct_flood").await >= 3).then_some(())
    })
    .await;
    the_backlog_is_held(&env, &file.path).await;

    // Another owner's one intent waits behind the flood's share only.
    let small = submit(&producer, "acct_small", "s-0", "small").await;
    wait_for_status(&env, small, JobStatus::Succeeded).await;
    let ahead: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM attempts a JOIN jobs j ON j.id = a.job_id
         WHERE j.owner_id = 'acct_flood'
           AND a.started_at > (SELECT created_at FROM jobs WHERE id = $1)
           AND a.started_at < (SELECT started_at FROM attempts WHERE job_id = $1)",
    )
    .bind(small.0)
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert!(
        ahead <= 1,
        "{ahead} of the flood's attempts started ahead of the other owner's job; its share is 1"
    );

    the_flood_ends(&env, &flood_jobs).await;
    producer.close().await;
    fleet.stop().await;
}

/// A held job that is cancelled ends its turn: its message is never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_job_cancelled_leaves_no_turn_and_no_message() {
    let text = common::config_text("http://127.0.0.1:9/v1", None, "")
        .replace("concurrency = 8", "concurrency = 2");
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let batch: Vec<_> = (0..3)
        .map(|i| common::new_job("acct_c", &format!("c-{i}"), "x"))
        .collect();
    let admitted = super::created(&env.store, &batch).await;
    let handed: Vec<bool> = admitted
        .iter()
        .map(|a| {
            matches!(
                a,
                onejob::edges::store::Admission::Created {
                    publish: Some(_),
                    ..
                }
            )
        })
        .collect();
    assert_eq!(handed, [true, false, false]);
    let held = batch[2].job_id.to_string();
    env.cli_ok(
        &file.path,
        &["jobs", "cancel", &held, "--reason", "not needed"],
    );
    let message = batch[2].attempt_id.to_string();
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM outbox WHERE message_id = $1",
            &message
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM turns WHERE attempt_id::text = $1",
            &message
        )
        .await,
        0
    );
    // The other held turn is still there, for the dispatcher.
    let other = batch[1].attempt_id.to_string();
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM turns WHERE attempt_id::text = $1 AND handed_out_at IS NULL",
            &other
        )
        .await,
        1
    );
}

/// The flood's backlog is held in the database, a share at most handed out,
/// and `jobs show` says why a held job waits.
async fn the_backlog_is_held(env: &TestEnv, config: &std::path::Path) {
    // The backlog is held in the database, a share at most handed out.
    let held = "SELECT count(*) FROM turns WHERE owner_id = $1 AND handed_out_at IS NULL";
    let out = "SELECT count(*) FROM turns WHERE owner_id = $1 AND handed_out_at IS NOT NULL";
    assert!(count(env, held, "acct_flood").await >= 10);
    assert!(count(env, out, "acct_flood").await <= 1);
    // `jobs show` says why a held job waits.
    let last: uuid::Uuid = sqlx::query_scalar(
        "SELECT a.job_id FROM turns t JOIN attempts a ON a.id = t.attempt_id
         WHERE t.owner_id = 'acct_flood' AND t.handed_out_at IS NULL ORDER BY t.seq DESC LIMIT 1",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    let shown = env.cli_ok(config, &["jobs", "show", &last.to_string()]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(text.contains("waits    its turn"), "{text}");
}

/// The whole flood ends, each job with its one attempt, and no turn or
/// outbox row is left behind.
async fn the_flood_ends(env: &TestEnv, flood_jobs: &[onejob::domain::JobId]) {
    // The whole flood ends, each job with its one attempt, and no turn or
    // outbox row is left behind.
    for job in flood_jobs {
        wait_for_status(env, *job, JobStatus::Succeeded).await;
    }
    let attempts = "SELECT count(*) FROM attempts a JOIN jobs j ON j.id = a.job_id
                    WHERE j.owner_id = $1";
    assert_eq!(count(env, attempts, "acct_flood").await, 30);
    assert_eq!(
        count(env, "SELECT count(*) FROM turns WHERE owner_id <> $1", "").await,
        0
    );
    wait_for("the outbox drained", Duration::from_secs(10), || async {
        let left = count(
            env,
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND exchange <> $1",
            "",
        )
        .await;
        (left == 0).then_some(())
    })
    .await;
}

/// Issue 40: a thousand owners ahead of another by name, each at its
/// `max_in_flight` with more waiting, do not starve it. A hand-out looks at
/// a thousand owners with room at most (the next goes on after the last it
/// looked at, round to the start), and an owner with no room takes no place:
/// the owner after them gets its turn at the next look, even one from the
/// first name (it never did: every look began at the first name, and owners
/// at their limit filled it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_past_the_first_thousand_by_name_get_their_turns() {
    let text = super::config_with_owners("http://127.0.0.1:9/v1", "max_in_flight = 1");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let ahead: Vec<_> = (0..1000)
        .flat_map(|i| {
            let owner = format!("o-{i:04}");
            [0, 1].map(|k| common::new_job(&owner, &format!("k{k}"), "x"))
        })
        .collect();
    for batch in ahead.chunks(500) {
        super::created(&env.store, batch).await;
    }
    let last = [0, 1].map(|k| common::new_job("zz-last", &format!("k{k}"), "x"));
    super::created(&env.store, &last).await;

    // Every turn is held (max_in_flight): the first look hands the first
    // thousand owners one turn each, which fills their room.
    let first = env
        .store
        .turns()
        .hand_out_turns("primary", 8, "")
        .await
        .unwrap();
    assert_eq!(first.publish.len(), 1000);
    assert_eq!(first.looked_to, "o-0999");
    // What an autoscaler sees: all the work waiting, held or handed out.
    let gauges = env.store.jobs().gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_provider_work_waiting{provider=\"primary\"} 2002\n"),
        "{gauges}"
    );
    // A look from the start: the thousand owners ahead have no room, and
    // take no place in it (each took one before, and zz-last waited for the
    // next look).
    let second = env
        .store
        .turns()
        .hand_out_turns("primary", 8, "")
        .await
        .unwrap();
    let handed: Vec<String> = second
        .publish
        .iter()
        .map(|m| m.message_id.clone())
        .collect();
    assert_eq!(
        handed,
        [last[0].attempt_id.to_string()],
        "zz-last's first turn"
    );
    assert_eq!(second.looked_to, "zz-last");
    // Now no owner has room: nothing is handed out, the rotation stays
    // where it was, and turns are still held.
    let third = env
        .store
        .turns()
        .hand_out_turns("primary", 8, &second.looked_to)
        .await
        .unwrap();
    assert!(third.publish.is_empty() && third.waiting, "{third:?}");
    assert_eq!(third.looked_to, "zz-last");
}

/// A first attempt held at admission keeps its message on its turn: no
/// outbox row until the turn is handed out, then one, leased, with the
/// message admission would have written. An admission run again after a
/// lost reply finds each job it made, held or handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_turn_writes_its_outbox_row_only_when_handed_out() {
    let text = super::config_with_owners("http://127.0.0.1:9/v1", "max_in_flight = 1");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let news: Vec<_> = (0..3)
        .map(|k| common::new_job("acct_h", &format!("k{k}"), "x"))
        .collect();
    super::created(&env.store, &news).await;
    let rows = |sql: &'static str| {
        let pool = env.store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .bind("acct_h")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let in_outbox = "SELECT count(*) FROM outbox o JOIN attempts a ON o.message_id = a.id::text
                     JOIN jobs j ON j.id = a.job_id WHERE j.owner_id = $1";
    let carried = "SELECT count(*) FROM turns
                   WHERE owner_id = $1 AND handed_out_at IS NULL AND body IS NOT NULL";
    assert_eq!((rows(in_outbox).await, rows(carried).await), (0, 3));

    // max_in_flight = 1: one is handed out, with the message it carried.
    let out = env
        .store
        .turns()
        .hand_out_turns("primary", 8, "")
        .await
        .unwrap();
    assert_eq!(out.publish.len(), 1, "{out:?}");
    let m = &out.publish[0];
    let first = &news[0];
    assert_eq!(
        (
            m.exchange.as_str(),
            m.routing_key.as_str(),
            m.message_id.clone()
        ),
        ("onejob", "attempts.primary", first.attempt_id.to_string())
    );
    assert_eq!(
        m.body,
        serde_json::json!({"attempt_id": first.attempt_id, "job_id": first.job_id})
    );
    assert_eq!((rows(in_outbox).await, rows(carried).await), (1, 2));

    // The same batch again, as after a reply lost with its commit: every job
    // is found as created; only the one handed out has a message to publish.
    let again = env.store.admission().admit(&news).await.unwrap();
    let publish: Vec<Option<String>> = again
        .iter()
        .map(|a| match a {
            onejob::edges::store::Admission::Created { publish, .. } => {
                publish.as_ref().map(|m| m.message_id.clone())
            }
            other => panic!("expected created, got {other:?}"),
        })
        .collect();
    assert_eq!(publish, [Some(first.attempt_id.to_string()), None, None]);
}
