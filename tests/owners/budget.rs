//! The daily token budget: spend counted from every attempt's reported
//! usage, discarded ones included, plus what open attempts hold reserved;
//! new identities whose reservation does not fit are refused (never retries
//! of accepted ones).

use std::time::Duration;

use onejob::broker;
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::edges::store::{Actor, Admission, OwnerChange};
use onejob::intent::{Outcome, RejectReason};
use onejob::mock::{MockHandle, MockOptions};
use onejob_producer::Producer;

use super::{config_with_owners, created, spend};
use crate::common::tempfile_path::TempConfig;
use crate::common::{self, RESERVE, TestEnv, config, mock, submit, wait_for_status};

fn refused(a: &Admission) -> (i64, i64, i64, u64) {
    match a {
        Admission::Refused(RejectReason::BudgetExceeded {
            spent,
            reserved,
            budget,
            retry_after,
            ..
        }) => (*spent, *reserved, *budget, *retry_after),
        other => panic!("expected budget_exceeded, got {other:?}"),
    }
}

/// A budget of 100, each new job reserving [`RESERVE`] (20): spend and
/// reservations together decide what is admitted, and a refusal says which
/// stands in the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_budget_refuses_new_identities_once_spend_reaches_it_and_still_answers_retries() {
    let (config, _file) = config(&config_with_owners(
        "http://127.0.0.1:9/v1",
        "daily_tokens = 100",
    ));
    let env = TestEnv::new(&config).await;
    let store = &env.store;

    // Spent 60; two more jobs reserve the 40 left.
    spend(store, "acct_a", "a-1", 60).await;
    created(
        store,
        &[
            common::new_job("acct_a", "a-2", "x"),
            common::new_job("acct_a", "a-3", "x"),
        ],
    )
    .await;
    let batch = [
        common::new_job("acct_a", "a-4", "x"),
        common::new_job("acct_b", "b-1", "x"),
        common::new_job("acct_a", "a-1", "a-1"),
        common::new_job("acct_a", "a-2", "changed"),
    ];
    let after = store.admission().admit(&batch).await.unwrap();
    let (spent, held, budget, retry_after) = refused(&after[0]);
    assert_eq!((spent, held, budget), (60, 2 * RESERVE, 100));
    assert_eq!(retry_after, 1, "only reservations stand in the way");
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
    let view = store.owners().owner("acct_a").await.unwrap();
    assert_eq!(
        (view.spent_24h, view.reserved, view.left),
        (60, 2 * RESERVE, Some(0))
    );
    let gauges = store.jobs().gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_owner_spent_tokens_24h{owner=\"acct_a\"} 60\n")
            && gauges.contains(&format!(
                "onejob_owner_reserved_tokens{{owner=\"acct_a\"}} {}\n",
                2 * RESERVE
            )),
        "{gauges}"
    );
    let (jobs,): (i64,) = sqlx::query_as("SELECT count(*) FROM jobs WHERE idempotency_key = 'a-4'")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(jobs, 0, "a refused intent makes no job");

    // The owner's own setting lies over [owners]: 0 is no budget for it, and
    // its jobs reserve nothing.
    let actor = Actor::cli(Some("a test lifts the budget"));
    let change = OwnerChange {
        daily_tokens: Some(Some(0)),
        ..Default::default()
    };
    let set = store.owners().set("acct_a", &change, &actor).await;
    let (view, _) = set.unwrap();
    assert_eq!(
        (view.limits.daily_tokens, view.spent_24h, view.left),
        (0, 60, None)
    );
    created(store, &[common::new_job("acct_a", "a-4", "x")]).await;
    assert_eq!(
        store.owners().owner("acct_a").await.unwrap().reserved,
        2 * RESERVE
    );
    each_budget_admits_or_says_how_long_to_wait(store, &actor).await;
}

/// `acct_a` spent 60 and holds two reservations: budgets set under it admit
/// or refuse the next job, with the wait each refusal gives.
async fn each_budget_admits_or_says_how_long_to_wait(
    store: &onejob::edges::store::Store,
    actor: &Actor,
) {
    // Room for one more reservation admits; where spend alone leaves no room
    // for it, the wait is until spend leaves the window; a job that needs
    // more than the whole budget waits a whole window.
    for (budget, admitted, wait) in [
        (60 + 3 * RESERVE, true, None),
        (60 + 3 * RESERVE, false, Some(1..=1)),
        (60 + RESERVE - 1, false, Some(2..=24 * 3600 + 60)),
        (RESERVE - 1, false, Some(24 * 3600 + 60..=24 * 3600 + 60)),
    ] {
        let change = OwnerChange {
            daily_tokens: Some(Some(budget)),
            ..Default::default()
        };
        store.owners().set("acct_a", &change, actor).await.unwrap();
        let key = format!("a-budget-{budget}-{admitted}");
        let a = store
            .admission()
            .admit(&[common::new_job("acct_a", &key, "x")])
            .await
            .unwrap();
        match wait {
            None => assert!(matches!(a[0], Admission::Created { .. }), "{budget}: {a:?}"),
            Some(wait) => {
                let (.., retry_after) = refused(&a[0]);
                assert!(wait.contains(&retry_after), "budget {budget}: {a:?}");
            }
        }
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
    assert_eq!(
        env.store.owners().owner("acct_h").await.unwrap().spent_24h,
        2 * each
    );

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

/// Issue 40, item 6: a late failed answer with usage. The hedge wins; the
/// primary's answer comes after, and breaks the output contract: its attempt
/// fails, and what the call cost is kept on it and counted against the owner
/// with the winner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_failed_answer_still_counts_its_cost() {
    let primary = mock(MockOptions {
        delay: Duration::from_secs(2),
        misbehave: Some(onejob::mock::Misbehaviour::Prose),
        ..MockOptions::default()
    })
    .await;
    let fallback = mock(MockOptions::default()).await;
    let (config, file) = config(&common::hedged_config(
        &primary.base_url(),
        &fallback.base_url(),
    ));
    let env = TestEnv::new(&config).await;
    env.cli_ok(&file.path, &["providers", "qualify", "fallback"]);
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_late", "k", "late failure").await;
    wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    let job = common::wait_for_attempt(&env, job_id, AttemptStatus::Failed).await;
    producer.close().await;
    fleet.stop().await;
    let late = job
        .attempts
        .iter()
        .find(|a| a.status == AttemptStatus::Failed)
        .unwrap();
    assert_eq!(late.provider, "primary");
    assert!(
        late.error
            .as_deref()
            .unwrap_or("")
            .starts_with("contract_violation"),
        "{late:?}"
    );
    let tokens = |u: &Option<serde_json::Value>| {
        u.as_ref()
            .map_or(0, |u| u["total_tokens"].as_i64().unwrap())
    };
    let all: i64 = job.attempts.iter().map(|a| tokens(&a.usage)).sum();
    assert!(
        tokens(&late.usage) > 0,
        "the late failure's usage is kept: {late:?}"
    );
    assert_eq!(
        env.store
            .owners()
            .owner("acct_late")
            .await
            .unwrap()
            .spent_24h,
        all
    );
}

/// Issue 40, item 6: an answer for an attempt already closed while its call
/// ran (an operator resolved it as cancelled) settles nothing, but what the
/// call cost is kept on the attempt and counted against the owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_for_an_attempt_closed_meanwhile_still_counts_its_cost() {
    closed_meanwhile(None).await;
}

/// The same for a failed answer with usage (one that breaks the contract).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_answer_for_an_attempt_closed_meanwhile_still_counts_its_cost() {
    closed_meanwhile(Some(onejob::mock::Misbehaviour::Prose)).await;
}

/// A job whose attempt an operator resolves as cancelled while its call runs,
/// against a provider that answers as `misbehave` says: the job ends
/// cancelled, and the late answer's cost is kept and counted.
async fn closed_meanwhile(misbehave: Option<onejob::mock::Misbehaviour>) {
    let primary = mock(MockOptions {
        delay: Duration::from_secs(2),
        misbehave,
        ..MockOptions::default()
    })
    .await;
    let (config, file) = config(&common::config_for(
        &[common::P(
            "primary",
            &primary.base_url(),
            "timeout = \"10s\"",
        )],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_closed", "k", "closed meanwhile").await;
    let job = common::wait_for_attempt(&env, job_id, AttemptStatus::Started).await;
    let attempt = job.attempts[0].id.to_string();
    env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &attempt,
            "--as",
            "cancelled",
            "--reason",
            "test",
        ],
    );
    let job = common::wait_for("the call's cost", Duration::from_secs(20), || async {
        let j = env.store.jobs().job(job_id).await.unwrap().unwrap();
        j.attempts[0].usage.is_some().then_some(j)
    })
    .await;
    producer.close().await;
    fleet.stop().await;
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Cancelled);
    let spent = env
        .store
        .owners()
        .owner("acct_closed")
        .await
        .unwrap()
        .spent_24h;
    assert!(spent > 0, "the call's cost counts: {spent}");
}
