//! Kept answers end: an answer kept on its attempt (its rows were held when
//! it arrived) is cleared in the transaction that settles it, a timeout's
//! included, and the kept-answer pass cannot be starved by answers it cannot
//! settle yet; the gauge says how many wait, and why.

use onejob_test_support as common;

use std::time::Duration;

use common::database::{Holder, give_up, started, success};
use common::{TestEnv, store_env, wait_for};
use onejob::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use onejob::edges::store::{Finished, HandedOn, KeptWaiting, Settled, Started, Verdict};
use onejob::fleet::Role;
use sqlx::{Connection, Executor, PgConnection};

/// Holds the rows of `jobs` under one open transaction, as an operator's
/// session or a long report may.
struct Held(PgConnection);

impl Held {
    async fn hold(env: &TestEnv, jobs: &[JobId]) -> Held {
        let mut conn = PgConnection::connect(&env.database_url).await.unwrap();
        conn.execute("BEGIN").await.unwrap();
        let ids: Vec<uuid::Uuid> = jobs.iter().map(|j| j.0).collect();
        let n = sqlx::query("SELECT id FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE")
            .bind(&ids)
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .len();
        assert_eq!(n, jobs.len());
        Held(conn)
    }

    async fn release(mut self) {
        self.0.execute("ROLLBACK").await.unwrap();
    }
}

async fn answer_kept(env: &TestEnv, attempt: AttemptId) -> bool {
    sqlx::query_scalar("SELECT answer IS NOT NULL FROM attempts WHERE id = $1")
        .bind(attempt.0)
        .fetch_one(env.store.pool())
        .await
        .unwrap()
}

/// An operator cancels `attempt` (`onejob attempts resolve --as cancelled`).
async fn cancelled_by_hand(env: &TestEnv, attempt: AttemptId) {
    let actor = onejob::edges::store::Actor::cli(Some("test"));
    env.store
        .settle()
        .resolve(
            attempt,
            onejob::edges::store::Resolution::Cancelled,
            &give_up,
            &actor,
        )
        .await
        .unwrap()
        .unwrap();
}

fn timed_out(s: &Started) -> Finished {
    Finished {
        verdict: Verdict::Unknown {
            error: "timeout: no answer within 1s".into(),
        },
        provider_request_id: None,
        usage: None,
        ..success(s)
    }
}

/// A timeout whose settlement met a held row is kept; settled once the row
/// is free (the attempt becomes `unknown`, still open), its kept answer is
/// cleared in that settlement, so no pass reads it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_timeout_is_cleared_by_the_settlement_that_makes_it_unknown() {
    let env = store_env().await;
    let s = started(&env.store, "kept-timeout", 1).await.remove(0);
    let finished = timed_out(&s);
    let held = Held::hold(&env, &[s.job_id]).await;
    let (settled, _) = env
        .store
        .settle()
        .finalize(std::slice::from_ref(&finished), &give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Busy]);
    assert!(env.store.kept().keep_answer(&finished, None).await.unwrap());
    assert!(answer_kept(&env, s.attempt_id).await);
    held.release().await;
    // Settled again, as its worker does (or the kept-answer pass).
    let (settled, _) = env
        .store
        .settle()
        .finalize(std::slice::from_ref(&finished), &give_up)
        .await
        .unwrap();
    assert_eq!(settled, vec![Settled::Unknown]);
    assert!(
        !answer_kept(&env, s.attempt_id).await,
        "the kept timeout is cleared with its settlement"
    );
    assert!(env.store.kept().answers(100).await.unwrap().is_empty());
    assert_eq!(
        env.store.kept().waiting().await.unwrap(),
        KeptWaiting::default()
    );
}

/// An attempt closed by another path (an operator's resolution) while an
/// answer is kept on it: the answer ends with it, and what it cost stays on
/// the attempt and in its owner's spend.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_answer_ends_with_its_attempt_and_its_cost_is_kept() {
    let env = store_env().await;
    let s = started(&env.store, "kept-closed", 1).await.remove(0);
    assert!(
        env.store
            .kept()
            .keep_answer(&success(&s), None)
            .await
            .unwrap()
    );
    cancelled_by_hand(&env, s.attempt_id).await;
    let (kept, usage, request_id): (bool, Option<serde_json::Value>, Option<String>) =
        sqlx::query_as(
            "SELECT answer IS NOT NULL, usage, provider_request_id FROM attempts WHERE id = $1",
        )
        .bind(s.attempt_id.0)
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert!(!kept, "the kept answer ended with its attempt");
    assert_eq!(usage, Some(serde_json::json!({"total_tokens": 10})));
    assert_eq!(request_id, Some(format!("req-{}", s.attempt_id)));
    let spent: Option<i64> = sqlx::query_scalar("SELECT sum(tokens)::int8 FROM owner_spend")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(spent, Some(10), "its cost counts in its owner's spend");
}

/// More kept answers than one pass reads, all with their rows held, and a
/// newer one whose rows are free: the pass settles the newer one all the
/// same (the held ones are moved behind it), and the gauge says how many
/// wait because their rows were held. Released, every one is settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kept_answers_that_cannot_be_settled_never_starve_the_rest() {
    let env = store_env().await;
    let mut all = started(&env.store, "kept-starve", 106).await;
    let free = all.pop().expect("the newest");
    for s in all.iter().chain([&free]) {
        assert!(
            env.store
                .kept()
                .keep_answer(&success(s), None)
                .await
                .unwrap()
        );
    }
    let jobs: Vec<JobId> = all.iter().map(|s| s.job_id).collect();
    let held = Held::hold(&env, &jobs).await;
    let (config, _file) = common::config(&common::config_text("http://127.0.0.1:9/v1", None, ""));
    let fleet = env.fleet(config, vec![Role::Reconciler]).await;
    let job = common::wait_for_status(&env, free.job_id, JobStatus::Succeeded).await;
    assert_eq!(job.completed_by, Some(free.attempt_id));
    assert!(!answer_kept(&env, free.attempt_id).await);
    let waiting = wait_for(
        "the held ones to be moved on",
        Duration::from_secs(30),
        || async {
            let w = env.store.kept().waiting().await.unwrap();
            (w.held == 105).then_some(w)
        },
    )
    .await;
    assert_eq!(waiting.unreadable, 0);
    let gauges = env.store.jobs().gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_kept_answers{why=\"held\"} 105"),
        "{gauges}"
    );
    held.release().await;
    for s in &all {
        let job = common::wait_for_status(&env, s.job_id, JobStatus::Succeeded).await;
        assert_eq!(job.attempts[0].status, AttemptStatus::Succeeded);
    }
    assert_eq!(
        env.store.kept().waiting().await.unwrap(),
        KeptWaiting::default()
    );
    fleet.stop().await;
}

/// A kept answer this version cannot read is set aside (an operator
/// resolves its attempt), counted as `unreadable`, and does not stand in
/// front of the answers that can be settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreadable_kept_answer_is_set_aside_and_counted() {
    let env = store_env().await;
    let mut both = started(&env.store, "kept-unreadable", 2).await;
    let good = both.pop().unwrap();
    let bad = both.pop().unwrap();
    assert!(
        env.store
            .kept()
            .keep_answer(&success(&good), None)
            .await
            .unwrap()
    );
    sqlx::query("UPDATE attempts SET answer = '{\"from\": \"a later version\"}' WHERE id = $1")
        .bind(bad.attempt_id.0)
        .execute(env.store.pool())
        .await
        .unwrap();
    let read = env.store.kept().answers(1).await.unwrap();
    assert!(
        read.is_empty(),
        "the first read sets the unreadable one aside"
    );
    let read = env.store.kept().answers(1).await.unwrap();
    assert_eq!(read.len(), 1);
    assert_eq!(read[0].attempt_id, good.attempt_id);
    let w = env.store.kept().waiting().await.unwrap();
    assert_eq!((w.due, w.unreadable), (1, 1), "{w:?}");
}

/// The console's overview says how many kept answers wait, and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_overview_says_how_many_kept_answers_wait_and_why() {
    let (config, _file) = common::config(&common::config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let mut three = started(&env.store, "kept-console", 3).await;
    for s in &three {
        assert!(
            env.store
                .kept()
                .keep_answer(&success(s), None)
                .await
                .unwrap()
        );
    }
    let held = three.pop().unwrap();
    env.store
        .kept()
        .later(&[held.attempt_id], Duration::from_secs(60))
        .await
        .unwrap();
    sqlx::query("UPDATE attempts SET answer = '{}' WHERE id = $1")
        .bind(three[0].attempt_id.0)
        .execute(env.store.pool())
        .await
        .unwrap();
    env.store.kept().answers(10).await.unwrap();
    let served = common::console::serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let (status, page) = served.get(&session.cookie, "/").await;
    assert!(status.is_success(), "{page}");
    let cards = &page[page
        .find("id=\"kept-answers\"")
        .expect("the kept-answers cards")..];
    let cards = &cards[..cards.find("</div>\n</div>").unwrap_or(cards.len())];
    for (n, why) in [(1, "due"), (1, "held"), (1, "unreadable")] {
        assert!(
            cards.contains(&format!("{n}</div><div class=\"l\">kept answers {why}")),
            "{why}: {cards}"
        );
    }
}

/// A settlement handed on through the broker is kept only on the open
/// attempt of its job started under the claim it names; its attempt row
/// held, nothing is written and it says so; an attempt under that claim
/// settled meanwhile keeps what the call cost, and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handed_on_settlement_is_kept_only_under_its_claim() {
    let env = store_env().await;
    let mut both = started(&env.store, "handed-on", 2).await;
    let (open, closed) = (both.remove(0), both.remove(0));
    let answer = success(&open);
    let keep = |f: Finished, claim: uuid::Uuid| {
        let store = env.store.clone();
        async move { store.kept().keep_handed_on(&f, claim).await.unwrap() }
    };
    assert_eq!(
        keep(answer.clone(), uuid::Uuid::new_v4()).await,
        HandedOn::NoSuchClaim
    );
    let mut elsewhere = answer.clone();
    elsewhere.job_id = closed.job_id;
    assert_eq!(keep(elsewhere, open.claim).await, HandedOn::NoSuchClaim);
    assert!(!answer_kept(&env, open.attempt_id).await);

    let held = Holder::hold_with_attempts(&env.database_url, open.job_id).await;
    assert_eq!(keep(answer.clone(), open.claim).await, HandedOn::Held);
    held.release().await;
    assert!(!answer_kept(&env, open.attempt_id).await);
    assert_eq!(keep(answer.clone(), open.claim).await, HandedOn::Kept);
    assert!(answer_kept(&env, open.attempt_id).await);

    cancelled_by_hand(&env, closed.attempt_id).await;
    assert_eq!(
        keep(success(&closed), closed.claim).await,
        HandedOn::Settled
    );
    let view = env.store.jobs().job(closed.job_id).await.unwrap().unwrap();
    assert_eq!(view.status, JobStatus::Cancelled);
    assert_eq!(view.attempts[0].status, AttemptStatus::Cancelled);
    assert_eq!(
        view.attempts[0].usage,
        Some(serde_json::json!({"total_tokens": 10})),
        "what the call cost is kept"
    );
    assert!(!answer_kept(&env, closed.attempt_id).await);
}
