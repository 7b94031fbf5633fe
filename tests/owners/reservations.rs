//! Budgets as reservations (contract section 7, Owners): a burst spends at
//! most its owner's budget; admissions that race for one owner never reserve
//! past it; every way an attempt ends replaces or releases its reservation.

use std::time::Duration;

use futures_util::future::join_all;
use onejob::domain::JobStatus;
use onejob::edges::store::{Actor, Admission, Finished, NewJob, Resolution, Store, Verdict};
use onejob::intent::{Outcome, RejectReason};
use onejob::mock::MockOptions;
use onejob_producer::Producer;
use serde_json::json;

use super::{config_with_owners, created};
use crate::common::{self, RESERVE, TestEnv, config, mock, wait_for_status};

/// The tokens `owner`'s open attempts hold reserved.
async fn reserved(store: &Store, owner: &str) -> i64 {
    store.owners().owner(owner).await.unwrap().reserved
}

/// A burst of 40 intents against a 100-token budget, through the fleet: the
/// jobs admitted reserve their prompt's tokens plus `max_tokens` (12) each,
/// so only those that fit are created, and what the provider was paid never
/// passes the budget. (Before reservations the budget was read only against
/// settled spend, and all 40 ran: 1,320 tokens.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_spends_at_most_its_budget() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(200),
        ..MockOptions::default()
    })
    .await;
    let text = config_with_owners(&primary.base_url(), "daily_tokens = 100").replace(
        "temperature = 0.0\n",
        "temperature = 0.0\nmax_tokens = 12\n",
    );
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let intents: Vec<_> = (0..40)
        .map(|i| common::intent("acct_burst", &format!("b-{i}"), "a burst"))
        .collect();
    let receipts: Vec<_> = join_all(intents.iter().map(|i| producer.submit(i)))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let reserve = {
        let new =
            onejob::shared::runtime::new_job(&config, &serde_json::to_vec(&intents[0]).unwrap())
                .unwrap();
        new.reserve
    };
    let jobs = created_or_refused(&receipts, reserve);
    for job in &jobs {
        wait_for_status(&env, *job, JobStatus::Succeeded).await;
    }
    let spent: i64 = sqlx::query_scalar(
        "SELECT COALESCE(sum(usage_tokens(a.usage)), 0)::int8 FROM attempts a
         JOIN jobs j ON j.id = a.job_id WHERE j.owner_id = 'acct_burst'",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    let view = env.store.owners().owner("acct_burst").await.unwrap();
    println!(
        "budget 100: {} of 40 created, each reserving {reserve}; {} calls spent {spent} tokens \
         ({} each); reserved now {}, left {:?}",
        jobs.len(),
        primary.stats.requests(),
        spent / i64::try_from(jobs.len().max(1)).unwrap(),
        view.reserved,
        view.left,
    );
    assert!(
        !jobs.is_empty() && jobs.len() < 40,
        "{} created",
        jobs.len()
    );
    assert!(
        i64::try_from(jobs.len()).unwrap() * reserve <= 100,
        "the reservations admitted fit in the budget"
    );
    assert!(spent <= 100, "spent {spent} of a 100-token budget");
    assert_eq!(
        (view.spent_24h, view.reserved),
        (spent, 0),
        "every settled call's usage replaced its reservation"
    );
    assert_eq!(primary.stats.uncapped(), 0, "every call carried max_tokens");

    producer.close().await;
    fleet.stop().await;
}

/// The jobs of the receipts that were created; every other receipt must be
/// a `budget_exceeded` refusal that names the job's reservation and a wait.
fn created_or_refused(
    receipts: &[onejob::intent::Receipt],
    reserve: i64,
) -> Vec<onejob::domain::JobId> {
    let mut jobs = Vec::new();
    for r in receipts {
        match r.outcome {
            Outcome::Created => jobs.push(r.job_id.unwrap()),
            Outcome::Rejected => {
                let error = r.error.clone().unwrap_or_default();
                assert!(
                    error.starts_with("budget_exceeded:")
                        && error.contains(&format!("this job would reserve {reserve}")),
                    "{error}"
                );
                assert!(
                    RejectReason::budget_retry_after(&error).is_some(),
                    "{error}"
                );
            }
            other => panic!("a new identity is created or refused: {other:?} {r:?}"),
        }
    }
    jobs
}

/// Twenty admissions race for one owner's 300-token budget, each of five new
/// jobs reserving 20: from twenty connections at once, they create exactly 15
/// jobs, and the reservations held are exactly the budget. Repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admissions_that_race_never_reserve_past_the_budget() {
    let (config, _file) = config(&config_with_owners(
        "http://127.0.0.1:9/v1",
        "daily_tokens = 300",
    ));
    let env = TestEnv::new(&config).await;
    for round in 0..5 {
        let owner = format!("acct_race_{round}");
        let batches: Vec<Vec<NewJob>> = (0..20)
            .map(|b| {
                (0..5)
                    .map(|k| common::new_job(&owner, &format!("r-{b}-{k}"), "x"))
                    .collect()
            })
            .collect();
        let admitted = join_all(batches.iter().map(|batch| {
            let store = env.store.clone();
            async move { store.admission().admit(batch).await.unwrap() }
        }))
        .await;
        let made = admitted
            .iter()
            .flatten()
            .filter(|a| matches!(a, Admission::Created { .. }))
            .count();
        let refused = admitted
            .iter()
            .flatten()
            .filter(|a| matches!(a, Admission::Refused(_)))
            .count();
        assert_eq!((made, refused), (15, 85), "round {round}");
        assert_eq!(reserved(&env.store, &owner).await, 15 * RESERVE);
    }
}

/// Each way an attempt ends: a settlement with usage replaces the
/// reservation by the usage; an `unknown` keeps it; an operator's resolution
/// with no usage releases it (counted `no_usage`); a cancel before the call
/// releases it (counted `no_call`); the room it leaves admits the next job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_ending_replaces_or_releases_the_reservation() {
    let (config, _file) = config(&config_with_owners(
        "http://127.0.0.1:9/v1",
        &format!("daily_tokens = {}", 3 * RESERVE),
    ));
    let env = TestEnv::new(&config).await;
    let store = &env.store;
    let owner = "acct_end";
    let news: Vec<NewJob> = (0..3)
        .map(|i| common::new_job(owner, &format!("e-{i}"), "x"))
        .collect();
    let (jobs, attempts): (Vec<_>, Vec<_>) = news.iter().map(|n| (n.job_id, n.attempt_id)).unzip();
    created(store, &news).await;
    assert_eq!(reserved(store, owner).await, 3 * RESERVE);
    let refused = store
        .admission()
        .admit(&[common::new_job(owner, "e-3", "x")])
        .await
        .unwrap();
    assert!(
        matches!(&refused[0], Admission::Refused(RejectReason::BudgetExceeded { need, reserved, retry_after: 1, .. }) if *need == RESERVE && *reserved == 3 * RESERVE),
        "only reservations stand in the way: a second's wait {refused:?}"
    );

    // A call that settles with usage: its usage replaces its reservation.
    let started = store
        .settle()
        .start("primary", &attempts[..2], Duration::from_secs(30))
        .await
        .unwrap();
    let first = started
        .iter()
        .find(|s| s.attempt_id == attempts[0])
        .unwrap();
    let finished = Finished {
        attempt_id: first.attempt_id,
        job_id: first.job_id,
        version: first.version,
        provider_request_id: None,
        usage: Some(json!({ "total_tokens": 7 })),
        verdict: Verdict::Succeeded(json!({ "summary": "x" })),
        asked: None,
    };
    common::settle_with(store, &[finished], &common::give_up).await;
    let view = store.owners().owner(owner).await.unwrap();
    assert_eq!((view.spent_24h, view.reserved), (7, 2 * RESERVE));
    assert_eq!(view.left, Some(RESERVE - 7));

    let second = started
        .iter()
        .find(|s| s.attempt_id == attempts[1])
        .unwrap();
    an_unknown_keeps_its_reservation_until_resolved(store, owner, second).await;

    // A job cancelled before its call releases its reservation.
    store
        .jobs()
        .cancel(jobs[2], &Actor::cli(Some("a test cancels it")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reserved(store, owner).await, 0);
    let gauges = store.jobs().gauges().await.unwrap();
    for why in ["no_call", "no_usage"] {
        let line = format!("onejob_reservations_released_unsettled_total{{why=\"{why}\"}} ");
        let n: i64 = gauges
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line} in {gauges}"));
        assert!(n >= 1, "{why}: {n}");
    }

    // The room they left admits again.
    created(store, &[common::new_job(owner, "e-3", "x")]).await;
    assert_eq!(reserved(store, owner).await, RESERVE);
}

/// A call whose outcome is unknown keeps its reservation; an operator who
/// resolves it with no usage releases it (its cost is in no budget).
async fn an_unknown_keeps_its_reservation_until_resolved(
    store: &Store,
    owner: &str,
    second: &onejob::edges::store::Started,
) {
    let unknown = Finished {
        attempt_id: second.attempt_id,
        job_id: second.job_id,
        version: second.version,
        provider_request_id: None,
        usage: None,
        verdict: Verdict::Unknown {
            error: "outcome_unknown: timed out".into(),
        },
        asked: None,
    };
    store
        .settle()
        .finalize(&[unknown], &common::give_up)
        .await
        .unwrap();
    assert_eq!(reserved(store, owner).await, 2 * RESERVE);
    store
        .settle()
        .resolve(
            second.attempt_id,
            Resolution::Failed,
            &common::give_up,
            &Actor::cli(Some("a test resolves it")),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reserved(store, owner).await, RESERVE);
}
