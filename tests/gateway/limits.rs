//! An owner whose budget leaves no room: its new requests are answered 429
//! with `Retry-After` and the `budget_exceeded` receipt before anything is
//! published, while a retry of an
//! accepted request still finds its job, and another owner is not touched.

use onejob::domain::JobStatus;
use onejob::edges::store::{Actor, OwnerChange};
use reqwest::StatusCode;

use super::{SUMMARIZE, Served};
use crate::common::{self, wait_for_status};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owner_over_its_budget_is_answered_429_with_retry_after() {
    let s = Served::start().await;
    let token = s.token("acct_budget");
    let other = s.token("acct_other");
    // A budget of one request's reservation: the first takes it all, and
    // once it has spent part of it the next does not fit.
    let one = common::intent("acct_budget", "b-0", "the quick fox");
    let reserve = onejob::shared::runtime::new_job(&s.config, &serde_json::to_vec(&one).unwrap())
        .unwrap()
        .reserve;
    let budget = OwnerChange {
        daily_tokens: Some(Some(reserve)),
        ..Default::default()
    };
    s.env
        .store
        .owners()
        .set("acct_budget", &budget, &Actor::cli(Some("test")))
        .await
        .unwrap();

    // Its reservation fits (nothing spent or reserved yet): created, and it
    // spends.
    let first = s.post(Some(&token), Some("b-0"), SUMMARIZE).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let job = first.job_id();
    wait_for_status(&s.env, job, JobStatus::Succeeded).await;
    let shown = s.get(&token, &job.to_string()).await;
    shown.conforms("/v1/jobs/{id}", "get");
    assert!(
        shown.body["attempts"][0]["not_before"].is_string(),
        "{shown:?}"
    );
    assert_eq!(shown.body["attempts"][0]["held"], false, "{shown:?}");

    let refused = s.post(Some(&token), Some("b-1"), SUMMARIZE).await;
    refused.conforms("/v1/jobs", "post");
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{refused:?}");
    assert_eq!(refused.body["outcome"], "rejected");
    let error = refused.body["error"].as_str().unwrap();
    assert!(error.starts_with("budget_exceeded:"), "{error}");
    let retry_after: u64 = refused
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After: {refused:?}"));
    assert!((1..=24 * 3600 + 60).contains(&retry_after), "{retry_after}");
    // Answered before publishing: intake never saw it, so nothing was
    // dead-lettered (the whole body was, before).
    let amqp = s.env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    let dlq = onejob::broker::dead_letter_queue(onejob::broker::INTENTS_QUEUE);
    assert_eq!(common::depth(&ch, &dlq).await, 0, "nothing dead-lettered");

    // A retry of the accepted request is still its job; another owner is
    // not touched.
    let again = s.post(Some(&token), Some("b-0"), SUMMARIZE).await;
    assert_eq!((again.status, again.job_id()), (StatusCode::OK, job));
    let theirs = s.post(Some(&other), Some("o-0"), SUMMARIZE).await;
    assert_eq!(theirs.status, StatusCode::CREATED, "{theirs:?}");
    s.stop().await;
}
