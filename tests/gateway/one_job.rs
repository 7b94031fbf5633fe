//! One job per request however often and however concurrently it is sent,
//! and each owner's view: only their own jobs, and errors in onejob's words.

use std::time::Duration;

use futures_util::future::join_all;
use onejob::domain::JobId;
use reqwest::StatusCode;

use super::{Answer, SUMMARIZE, Served};
use crate::common::{self, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_is_one_job_however_often_and_however_concurrently_it_is_sent() {
    let s = Served::start().await;
    let token = s.token("acct_1");

    let first = s.post(Some(&token), Some("k-0"), SUMMARIZE).await;
    first.conforms("/v1/jobs", "post");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.body["outcome"], "created");
    let job_id = first.job_id();
    assert_eq!(
        first.header("location"),
        Some(format!("/v1/jobs/{job_id}").as_str())
    );

    // The same request again, with its keys reordered and spaced: a duplicate.
    let again = s
        .post(
            Some(&token),
            Some("k-0"),
            r#"{ "input" : { "text" : "the quick fox" },
                 "operation" : "summarize" }"#,
        )
        .await;
    again.conforms("/v1/jobs", "post");
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.body["outcome"], "duplicate");
    assert_eq!(again.job_id(), job_id);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));

    // Double clicks: many identical requests racing on fresh keys, round after round.
    for round in 1..=3 {
        let key = format!("k-{round}");
        let answers = join_all((0..20).map(|_| s.post(Some(&token), Some(&key), SUMMARIZE))).await;
        let created = answers
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .count();
        let replayed = answers
            .iter()
            .filter(|a| a.status == StatusCode::OK)
            .count();
        assert_eq!((created, replayed), (1, 19), "round {round}: {answers:?}");
        let ids: std::collections::BTreeSet<JobId> = answers.iter().map(Answer::job_id).collect();
        assert_eq!(ids.len(), 1, "round {round}: one job for all of them");
        let (jobs,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM jobs WHERE owner_id = 'acct_1' AND idempotency_key = $1",
        )
        .bind(&key)
        .fetch_one(s.env.store.pool())
        .await
        .unwrap();
        assert_eq!(jobs, 1);
    }

    // The same key for a different request: a conflict that reveals nothing.
    let conflict = s
        .post(
            Some(&token),
            Some("k-0"),
            r#"{"operation":"summarize","input":{"text":"something else"}}"#,
        )
        .await;
    conflict.conforms("/v1/jobs", "post");
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(conflict.body["outcome"], "conflict");
    assert!(conflict.body["job_id"].is_null());
    assert!(
        conflict.body["error"]
            .as_str()
            .unwrap()
            .starts_with("conflict: Idempotency-Key \"k-0\"")
    );

    // The owner watches the job succeed.
    let done = wait_for(
        "the job to succeed over HTTP",
        Duration::from_secs(20),
        || async {
            let a = s.get(&token, &job_id.to_string()).await;
            (a.body["status"] == "succeeded").then_some(a)
        },
    )
    .await;
    done.conforms("/v1/jobs/{id}", "get");
    assert_eq!(
        done.body["result"]["summary"],
        "mock answer: Summarize: the quick fox"
    );
    assert_eq!(done.body["owner_id"], "acct_1");
    assert_eq!(done.body["attempts"][0]["status"], "succeeded");
    // The owner's view, not the operator's: no usage, request ids or fingerprints
    // (the schema allows no other field, and `conforms` checked it).
    for internal in ["request_fingerprint", "completed_by"] {
        assert!(done.body.get(internal).is_none(), "{internal} shown");
    }
    assert!(done.body["attempts"][0].get("usage").is_none());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_see_only_their_own_jobs() {
    let s = Served::start().await;
    let alice = s.token("alice");
    let bob = s.token("bob");

    // The same key under two owners: two identities, two jobs.
    let a = s.post(Some(&alice), Some("shared-key"), SUMMARIZE).await;
    let b = s.post(Some(&bob), Some("shared-key"), SUMMARIZE).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_ne!(a.job_id(), b.job_id());

    let mine = s.get(&alice, &a.job_id().to_string()).await;
    assert_eq!(mine.status, StatusCode::OK);
    mine.conforms("/v1/jobs/{id}", "get");
    // Bob's view of Alice's job is the same as of a job that does not exist.
    let theirs = s.get(&bob, &a.job_id().to_string()).await;
    let missing = s.get(&bob, &uuid::Uuid::now_v7().to_string()).await;
    let garbage = s.get(&bob, "not-a-uuid").await;
    for answer in [&theirs, &missing, &garbage] {
        assert_eq!(answer.status, StatusCode::NOT_FOUND, "{answer:?}");
        answer.conforms("/v1/jobs/{id}", "get");
        assert!(
            answer.body["error"]
                .as_str()
                .unwrap()
                .starts_with("not_found")
        );
    }
    s.stop().await;
}

/// Item 14 of issue 8: the owner's view of a failed job says what went wrong in
/// onejob's words, as a stable code and a short message, never the provider's
/// own error text (which the operator CLI still shows).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_see_a_stable_error_code_not_provider_internals() {
    let s = Served::start().await;
    let alice = s.token("alice");
    let body = r#"{"operation":"summarize","input":{"text":"mock:status=401"}}"#;
    let created = s.post(Some(&alice), Some("refused"), body).await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    let job_id = created.job_id();
    common::wait_for_status(&s.env, job_id, onejob::domain::JobStatus::Failed).await;

    let seen = s.get(&alice, &job_id.to_string()).await;
    assert_eq!(seen.status, StatusCode::OK);
    seen.conforms("/v1/jobs/{id}", "get");
    assert_eq!(
        seen.body["error"]["code"], "provider_error",
        "{}",
        seen.body
    );
    assert!(
        seen.body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
    let text = seen.body.to_string();
    for internal in ["HTTP 401", "asked to fail", "mock_error"] {
        assert!(
            !text.contains(internal),
            "{internal:?} shown to the owner: {text}"
        );
    }
    // The operator still sees the provider's own words.
    let operator = s.env.cli_ok(
        &s.file.path,
        &["jobs", "show", &job_id.to_string(), "--json"],
    );
    assert!(String::from_utf8_lossy(&operator.stdout).contains("HTTP 401"));
    s.stop().await;
}
