//! The daily token budget: counted from every attempt's reported usage,
//! discarded ones included, and refusing new identities (never retries of
//! accepted ones) from the settlement that reaches it.

use std::time::Duration;

use onejob::broker;
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::intent::{Outcome, RejectReason};
use onejob::mock::{MockHandle, MockOptions};
use onejob::store::{Actor, Admission, OwnerChange};
use onejob_producer::Producer;

use super::{config_with_owners, created, spend};
use crate::common::tempfile_path::TempConfig;
use crate::common::{self, TestEnv, config, mock, submit, wait_for_status};

fn refused(a: &Admission) -> (i64, i64, u64) {
    match a {
        Admission::Refused(RejectReason::BudgetExceeded {
            spent,
            budget,
            retry_after,
            ..
        }) => (*spent, *budget, *retry_after),
        other => panic!("expected budget_exceeded, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_budget_refuses_new_identities_once_spend_reaches_it_and_still_answers_retries() {
    let (config, _file) = config(&config_with_owners(
        "http://127.0.0.1:9/v1",
        "daily_tokens = 100",
    ));
    let env = TestEnv::new(&config).await;
    let store = &env.store;

    // One token under the budget: still admitted.
    spend(store, "acct_a", "a-1", 99).await;
    created(store, &[common::new_job("acct_a", "a-2", "x")]).await;
    // The settlement that reaches it: the next new identity is refused.
    spend(store, "acct_a", "a-3", 1).await;
    let after = store
        .admit(&[
            common::new_job("acct_a", "a-4", "x"),
            common::new_job("acct_b", "b-1", "x"),
            common::new_job("acct_a", "a-1", "a-1"),
            common::new_job("acct_a", "a-2", "changed"),
        ])
        .await
        .unwrap();
    let (spent, budget, retry_after) = refused(&after[0]);
    assert_eq!((spent, budget), (100, 100));
    assert!(
        (1..=24 * 3600 + 60).contains(&retry_after),
        "the spend leaves the window within a day and a minute: {retry_after}"
    );
    assert!(
        matches!(after[1], Admission::Created { .. }),
        "another owner has its own budget: {:?}",
        after[1]
    );
    assert!(
        matches!(after[2], Admission::Duplicate { .. }),
        "a retry of an accepted intent still finds its job: {:?}",
        after[2]
    );
    assert_eq!(after[3], Admission::Conflict);
    let gauges = store.gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_owner_spent_tokens_24h{owner=\"acct_a\"} 100\n"),
        "{gauges}"
    );
    let (jobs,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs WHERE idempotency_key = 'a-4'")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, 0, "a refused intent makes no job");

    // The owner's own setting lies over [owners]: 0 is no budget for it.
    let actor = Actor::cli(Some("a test lifts the budget"));
    let change = OwnerChange {
        daily_tokens: Some(Some(0)),
        ..Default::default()
    };
    let (view, _) = store.set_owner("acct_a", &change, &actor).await.unwrap();
    assert_eq!((view.limits.daily_tokens, view.spent_24h), (0, 100));
    created(store, &[common::new_job("acct_a", "a-4", "x")]).await;
    // And one above its spend admits again, while one at it refuses.
    for (budget, admitted) in [(101, true), (100, false)] {
        let change = OwnerChange {
            daily_tokens: Some(Some(budget)),
            ..Default::default()
        };
        store.set_owner("acct_a", &change, &actor).await.unwrap();
        let key = format!("a-budget-{budget}");
        let a = store
            .admit(&[common::new_job("acct_a", &key, "x")])
            .await
            .unwrap();
        assert_eq!(
            matches!(a[0], Admission::Created { .. }),
            admitted,
            "budget {budget}, spent 100: {:?}",
            a[0]
        );
    }
}

/// A fleet whose primary answers in 2 s and whose qualified fallback is
/// hedged after 300 ms, with the mocks that keep it answering.
async fn hedged_fleet() -> (TestEnv, TempConfig, common::Fleet, [MockHandle; 2]) {
    let primary = mock(MockOptions {
        delay: Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let fallback = mock(MockOptions::default()).await;
    let (p, f) = (primary.base_url(), fallback.base_url());
    let (config, file) = config(&common::hedged_config(&p, &f));
    let env = TestEnv::new(&config).await;
    env.cli_ok(&file.path, &["providers", "qualify", "fallback"]);
    let fleet = env.fleet(config.clone(), vec![]).await;
    (env, file, fleet, [primary, fallback])
}

/// A hedge wins and the primary's late answer is discarded: its spend counts
/// against the owner's budget as the winner's does, and it is what crosses the
/// budget. The next intent is rejected with `budget_exceeded`, dead-lettered
/// with the reason, and makes no job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_discarded_hedges_spend_crosses_the_budget() {
    let (env, file, fleet, _mocks) = hedged_fleet().await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job_id = submit(&producer, "acct_h", "k", "hedge me").await;
    let won = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    let winner = won
        .attempts
        .iter()
        .find(|a| Some(a.id) == won.completed_by)
        .unwrap();
    let tokens =
        |u: &Option<serde_json::Value>| u.as_ref().unwrap()["total_tokens"].as_i64().unwrap();
    let each = tokens(&winner.usage);
    assert!(each > 1, "the mock reports usage: {each}");
    // The winner alone is under this budget; with the discarded answer's
    // spend the owner is at or over it.
    let budget = 2 * each - 1;
    let set = format!("owners set acct_h --daily-tokens {budget} --reason a-test's-budget");
    env.cli_ok(&file.path, &set.split(' ').collect::<Vec<_>>());
    let job = common::wait_for_attempt(&env, job_id, AttemptStatus::Discarded).await;
    let discarded = job
        .attempts
        .iter()
        .find(|a| a.status == AttemptStatus::Discarded)
        .unwrap();
    assert_eq!(tokens(&discarded.usage), each);
    assert_eq!(env.store.owner("acct_h").await.unwrap().spent_24h, 2 * each);

    let receipt = producer
        .submit(&common::intent("acct_h", "k2", "one more"))
        .await
        .unwrap();
    assert_eq!(receipt.outcome, Outcome::Rejected, "{receipt:?}");
    assert_eq!(receipt.job_id, None);
    let error = receipt.error.unwrap_or_default();
    assert!(
        error.starts_with("budget_exceeded:")
            && error.contains(&format!("spent {}", 2 * each))
            && error.contains(&format!("budget is {budget}")),
        "{error}"
    );
    assert!(
        RejectReason::budget_retry_after(&error).is_some(),
        "{error}"
    );
    // A retry of the accepted intent is still its job.
    let again = producer
        .submit(&common::intent("acct_h", "k", "hedge me"))
        .await
        .unwrap();
    assert_eq!(
        (again.outcome, again.job_id),
        (Outcome::Duplicate, Some(job_id))
    );

    the_dead_letter_says_why(&env).await;

    producer.close().await;
    fleet.stop().await;
}

/// The refused intent is in the intents' dead-letter queue with its reason.
async fn the_dead_letter_says_why(env: &TestEnv) {
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    let dlq = broker::dead_letter_queue(broker::INTENTS_QUEUE);
    let dead = common::wait_for_messages(env, &ch, &dlq).await;
    let headers = dead[0].properties.headers().clone().unwrap_or_default();
    let reason = broker::header_str(&headers, broker::ERROR_HEADER).unwrap_or_default();
    assert!(reason.starts_with("budget_exceeded:"), "{reason}");
}
