//! `max_in_flight`: an owner's attempts `started` at once never pass it; its
//! jobs are still created, and their first attempts wait their turn. A hedge
//! is an attempt in flight too, and waits for room like a turn.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::future::join_all;
use onejob::domain::JobStatus;
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use crate::common::{self, TestEnv, config, mock, submit, wait_for_status};

/// The most of `owner`'s attempts that were ever `started` at once, from
/// their start and finish times. A settlement commits before the hand-out it
/// makes room for, so the next attempt's start is later than the finish it
/// waited for; an end and a start at the same instant do not overlap.
pub(super) async fn most_at_once(env: &TestEnv, owner: &str) -> usize {
    let rows: Vec<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT a.started_at, a.finished_at FROM attempts a JOIN jobs j ON j.id = a.job_id
         WHERE j.owner_id = $1 AND a.started_at IS NOT NULL",
    )
    .bind(owner)
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    let mut edges: Vec<(DateTime<Utc>, i32)> = Vec::new();
    for (start, end) in rows {
        edges.push((start, 1));
        edges.push((end, -1));
    }
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    usize::try_from(most).unwrap()
}

/// Submits `n` intents of `owner` at once; all are created; their jobs.
pub(super) async fn flood(
    producer: &Producer,
    owner: &str,
    n: usize,
) -> Vec<onejob::domain::JobId> {
    let intents: Vec<_> = (0..n)
        .map(|i| common::intent(owner, &format!("{owner}-{i}"), "in flight"))
        .collect();
    let mut jobs = Vec::new();
    for r in join_all(intents.iter().map(|i| producer.submit(i))).await {
        let r = r.unwrap();
        assert_eq!(r.outcome, Outcome::Created, "a limit is a wait: {r:?}");
        jobs.push(r.job_id.unwrap());
    }
    jobs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owners_started_attempts_never_pass_its_max_in_flight() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(800),
        ..MockOptions::default()
    })
    .await;
    let (config, file) = config(&common::config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    env.cli_ok(
        &file.path,
        &[
            "owners",
            "set",
            "acct_m",
            "--max-in-flight",
            "2",
            "--reason",
            "test",
        ],
    );
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let (limited, free) =
        tokio::join!(flood(&producer, "acct_m", 8), flood(&producer, "acct_f", 8));
    // The last in the limited owner's line waits its turn, and says so. (The
    // intents were sent at once: which job is last is read, not assumed.
    // Three pairs of calls stand before it.)
    let last: uuid::Uuid = sqlx::query_scalar(
        "SELECT a.job_id FROM turns t JOIN attempts a ON a.id = t.attempt_id
         WHERE t.owner_id = 'acct_m' AND t.handed_out_at IS NULL
         ORDER BY t.seq DESC LIMIT 1",
    )
    .fetch_one(env.store.pool())
    .await
    .expect("the limited owner has turns held");
    let shown = env.cli_ok(&file.path, &["jobs", "show", &last.to_string()]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("waits    its turn") && text.contains("max_in_flight 2"),
        "{text}"
    );
    for job in limited.iter().chain(&free) {
        wait_for_status(&env, *job, JobStatus::Succeeded).await;
    }
    assert_eq!(most_at_once(&env, "acct_m").await, 2);
    // The limit is the owner's own: the other owner ran more at once.
    assert!(most_at_once(&env, "acct_f").await > 2);
    producer.close().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hedge_waits_for_room_under_max_in_flight() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(1500),
        ..MockOptions::default()
    })
    .await;
    let fallback = mock(MockOptions::default()).await;
    let text = common::hedged_config(&primary.base_url(), &fallback.base_url())
        + "\n[owners]\nmax_in_flight = 1\n";
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    env.cli_ok(&file.path, &["providers", "qualify", "fallback"]);
    env.cli_ok(
        &file.path,
        &[
            "owners",
            "set",
            "acct_free",
            "--max-in-flight",
            "0",
            "--reason",
            "test",
        ],
    );
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    // At its limit of one, the slow primary is the owner's only attempt.
    let limited = submit(&producer, "acct_one", "k", "slow").await;
    let job = wait_for_status(&env, limited, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "{:?}", job.attempts);
    // With no limit of its own, an owner's slow primary is hedged.
    let hedged = submit(&producer, "acct_free", "k", "slow").await;
    let job = wait_for_status(&env, hedged, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 2, "{:?}", job.attempts);
    producer.close().await;
    fleet.stop().await;
}

/// Issue 40: a call that timed out may still run at the provider, so its
/// attempt stays in flight while it is `unknown`, until evidence settles it.
/// An owner at `max_in_flight = 2` whose every call outlasts its timeout
/// never has more than two of them running at the provider (it had as many
/// as its jobs: each timeout handed the next turn out).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_that_timed_out_still_count_against_max_in_flight() {
    let slow = mock(MockOptions {
        store: true,
        delay: Duration::from_millis(1500),
        ..MockOptions::default()
    })
    .await;
    let provider = "timeout = \"500ms\"\nevidence = \"stored\"\nevidence_delay = \"1s\"";
    let text = common::config_for(&[common::P("primary", &slow.base_url(), provider)], "")
        + "\n[owners]\nmax_in_flight = 2\n";
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let jobs = flood(&producer, "acct_slow", 6).await;
    for job in &jobs {
        wait_for_status(&env, *job, JobStatus::Succeeded).await;
    }
    let unknowns: i64 = sqlx::query_scalar("SELECT count(*) FROM audit WHERE actor = 'evidence'")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(unknowns, 6, "every call timed out, and evidence settled it");
    assert_eq!(slow.stats.work(), 6, "one call a job");
    assert_eq!(
        slow.stats.most_running(),
        2,
        "never more than max_in_flight running at the provider"
    );
    producer.close().await;
    fleet.stop().await;
}

/// Issue 40, item 2: a call discarded while its outcome was unknown (here its
/// job was cancelled) may still be running at the provider, so it counts in
/// its owner's flight while evidence looks for what it cost. An owner at
/// `max_in_flight = 1` never has two calls running at the provider: the next
/// job starts once the first call's cost was found.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_discarded_while_unknown_counts_until_its_cost_is_found() {
    let primary = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let provider = "timeout = \"500ms\"\nevidence = \"stored\"\nevidence_delay = \"1s\"";
    let text = common::config_for(&[common::P("primary", &primary.base_url(), provider)], "")
        + "\n[owners]\nmax_in_flight = 1\n";
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let first = submit(&producer, "acct_disc", "k1", "first").await;
    wait_for_status(&env, first, JobStatus::Unknown).await;
    let second = submit(&producer, "acct_disc", "k2", "second").await;
    env.cli_ok(&file.path, &["jobs", "cancel", &first.to_string()]);
    wait_for_status(&env, second, JobStatus::Succeeded).await;
    let first = env.store.jobs().job(first).await.unwrap().unwrap();
    assert_eq!(
        first.attempts[0].status,
        onejob::domain::AttemptStatus::Discarded
    );
    assert!(
        first.attempts[0].usage.is_some(),
        "its cost was found: {first:?}"
    );
    assert_eq!(
        primary.stats.most_running(),
        1,
        "the second call waited for the first to end"
    );
    producer.close().await;
    fleet.stop().await;
}
