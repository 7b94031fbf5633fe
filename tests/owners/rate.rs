//! The rate: an owner's new jobs past its burst are created at once, and their
//! first attempts are handed to the provider's queue 1/rate apart, however
//! many admissions race for the owner.

use chrono::{DateTime, Utc};
use futures_util::future::join_all;
use onejob::domain::JobStatus;
use onejob::edges::store::{Admission, Store};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use super::{config_with_owners, created};
use crate::common::{self, TestEnv, config, mock, submit, wait_for_status};

/// Each first attempt's due time, for an owner's jobs, in order.
async fn due_times(store: &Store, owner: &str) -> Vec<DateTime<Utc>> {
    sqlx::query_scalar(
        "SELECT a.not_before FROM attempts a JOIN jobs j ON j.id = a.job_id
         WHERE j.owner_id = $1 AND a.number = 1 ORDER BY a.not_before",
    )
    .bind(owner)
    .fetch_all(store.pool())
    .await
    .unwrap()
}

/// Milliseconds from `a` to `b`, to the nearest: the due times are computed
/// in floating point and stored to the microsecond.
fn millis(a: DateTime<Utc>, b: DateTime<Utc>) -> i64 {
    ((b - a).num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0).round() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_its_burst_an_owners_first_attempts_are_due_one_interval_apart() {
    let (config, file) = config(&config_with_owners(
        "http://127.0.0.1:9/v1",
        "rate = 0.1\nburst = 3",
    ));
    let env = TestEnv::new(&config).await;
    let store = &env.store;

    let batch: Vec<_> = (0..5)
        .map(|i| common::new_job("acct_r", &format!("r-{i}"), "x"))
        .collect();
    let admitted = created(store, &batch).await;
    // The burst goes out now, leased to the admitting worker; the rest wait
    // for the relay.
    let now: Vec<bool> = admitted
        .iter()
        .map(|a| {
            matches!(
                a,
                Admission::Created {
                    publish: Some(_),
                    ..
                }
            )
        })
        .collect();
    assert_eq!(now, [true, true, true, false, false]);
    // A retry is no new job: it spends nothing of the bucket.
    let again = store
        .admission()
        .admit(&[common::new_job("acct_r", "r-0", "x")])
        .await
        .unwrap();
    assert!(matches!(again[0], Admission::Duplicate { .. }));
    created(store, &[common::new_job("acct_r", "r-5", "x")]).await;

    // `jobs show` says why the job waits, and the owner's limits.
    let shown = env.cli_ok(&file.path, &["jobs", "show", &batch[4].job_id.to_string()]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("waits    until") && text.contains("its turn under the owner's rate"),
        "{text}"
    );
    assert!(
        text.contains("its limits   max_in_flight none  rate 0.1/s burst 3"),
        "{text}"
    );
    let gauges = store.jobs().gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_owner_waiting_jobs{owner=\"acct_r\"} 3\n"),
        "{gauges}"
    );
    let due = due_times(store, "acct_r").await;
    assert_eq!(due.len(), 6);
    assert_eq!(
        millis(due[0], due[2]),
        0,
        "the burst is due at once: {due:?}"
    );
    // Within one admission the spacing is exact; across two, the second is
    // due a whole interval after the first one's last job.
    assert_eq!(millis(due[2], due[3]), 10_000, "{due:?}");
    assert_eq!(millis(due[3], due[4]), 10_000, "{due:?}");
    assert!(millis(due[4], due[5]) >= 10_000, "{due:?}");

    // Another owner has a bucket of its own.
    let other = created(store, &[common::new_job("acct_s", "s-0", "x")]).await;
    assert!(matches!(
        other[0],
        Admission::Created {
            publish: Some(_),
            ..
        }
    ));
}

/// Two workers' stores admit one owner's intents at once, again and again:
/// the bucket is one, so no two first attempts of the owner are due closer
/// than 1/rate past the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admissions_that_race_share_one_bucket() {
    let (config, _file) = config(&config_with_owners(
        "http://127.0.0.1:9/v1",
        "rate = 50\nburst = 1",
    ));
    let env = TestEnv::new(&config).await;
    let second = common::chaos::store(&env, &config).await;
    for round in 0..10 {
        let admit = |store: &Store, side: &str| {
            let batch: Vec<_> = (0..4)
                .map(|i| common::new_job("acct_race", &format!("{round}-{side}-{i}"), "x"))
                .collect();
            let store = store.clone();
            async move { store.admission().admit(&batch).await.unwrap() }
        };
        let answers = join_all([
            admit(&env.store, "a"),
            admit(&second, "b"),
            admit(&env.store, "c"),
        ])
        .await;
        for a in answers.iter().flatten() {
            assert!(matches!(a, Admission::Created { .. }), "{a:?}");
        }
    }
    let due = due_times(&env.store, "acct_race").await;
    assert_eq!(due.len(), 120);
    for pair in due.windows(2) {
        assert!(
            millis(pair[0], pair[1]) >= 20,
            "two first attempts due {} ms apart: {pair:?}",
            millis(pair[0], pair[1])
        );
    }
    second.close().await;
}

/// Through the fleet: a paced job's first attempt is published by the relay
/// when it is due, and starts no sooner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paced_job_runs_when_its_turn_comes() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_with_owners(
        &primary.base_url(),
        "rate = 2\nburst = 1",
    ));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let mut jobs = Vec::new();
    for i in 0..3 {
        jobs.push(submit(&producer, "acct_p", &format!("p-{i}"), "paced").await);
    }
    let owner = env.store.owners().owner("acct_p").await.unwrap();
    assert!(
        owner.waiting >= 1,
        "the later jobs wait their turn: {owner:?}"
    );
    let mut started = Vec::new();
    for job in jobs {
        let done = wait_for_status(&env, job, JobStatus::Succeeded).await;
        started.push(done.attempts[0].started_at.unwrap());
    }
    let due = due_times(&env.store, "acct_p").await;
    for (s, d) in started.iter().zip(&due) {
        assert!(s >= d, "started {s} before it was due {d}");
    }
    assert!(millis(due[0], due[2]) >= 1000, "{due:?}");
    assert_eq!(env.store.owners().owner("acct_p").await.unwrap().waiting, 0);
    producer.close().await;
    fleet.stop().await;
}
