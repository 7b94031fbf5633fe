//! What a provider sends is not trusted: a `Retry-After` far in the future, a
//! proxy's timeout page, NUL bytes and answers over `max_response_bytes`.

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobId, JobStatus};

use super::Running;
use crate::common::{TestEnv, submit, wait_for, wait_for_status};

/// Waits until the job has `n` attempts, and returns it.
async fn with_attempts(env: &TestEnv, job_id: JobId, n: usize) -> onejob::edges::store::JobView {
    wait_for(
        &format!("job {job_id} to have {n} attempts"),
        Duration::from_secs(20),
        || async {
            env.store
                .jobs()
                .job(job_id)
                .await
                .unwrap()
                .filter(|j| j.attempts.len() == n)
        },
    )
    .await
}

/// Item 1: a `Retry-After` far in the future (chrono panicked on it, stopping the
/// attempts role) is capped at the provider's `max_retry_after`, default 10m.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_huge_retry_after_is_capped_and_never_crashes_the_worker() {
    let Running {
        primary: _primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("", 2).await;
    let job_id = submit(
        &producer,
        "acct_ra",
        "k",
        "mock:status=429 mock:retry_after=99999999999999",
    )
    .await;
    let job = with_attempts(&env, job_id, 2).await;
    let wait = job.attempts[1].not_before - job.attempts[0].finished_at.unwrap();
    let cap = chrono::Duration::minutes(10);
    assert!(
        wait >= cap - chrono::Duration::seconds(1) && wait <= cap + chrono::Duration::seconds(1),
        "the wait is capped at max_retry_after (10m): waited {wait}"
    );
    // The same header from a second job: the role is still there to take it.
    let second = submit(
        &producer,
        "acct_ra",
        "k2",
        "mock:status=429 mock:retry_after=99999999999999",
    )
    .await;
    with_attempts(&env, second, 2).await;
    producer.close().await;
    fleet.stop().await;
}

/// Item 10: a proxy's 504 or 524 says it forwarded the request and stopped
/// waiting: the provider may have run it, so the attempt is `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn proxy_timeouts_are_unknown() {
    let Running {
        primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("", 3).await;
    for status in [504, 524] {
        let job_id = submit(
            &producer,
            "acct_504",
            &status.to_string(),
            &format!("mock:status={status}"),
        )
        .await;
        let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
        assert_eq!(job.attempts.len(), 1);
        assert_eq!(job.attempts[0].status, AttemptStatus::Unknown);
        let error = job.attempts[0].error.clone().unwrap_or_default();
        assert!(
            error.starts_with("outcome_unknown") && error.contains(&status.to_string()),
            "{error}"
        );
    }
    assert_eq!(primary.stats.requests(), 2, "no retry beside an unknown");
    // A proxy's timeout page larger than max_response_bytes is still unknown.
    let run = Running::start("max_response_bytes = 1024", 3).await;
    let job_id = submit(
        &run.producer,
        "acct_504",
        "big",
        "mock:status=504 mock:pad=5000",
    )
    .await;
    let job = wait_for_status(&run.env, job_id, JobStatus::Unknown).await;
    assert_eq!(job.attempts[0].status, AttemptStatus::Unknown, "{job:?}");
    run.producer.close().await;
    run.fleet.stop().await;
    producer.close().await;
    fleet.stop().await;
}

/// Item 9: NUL in what a provider sends cannot be stored by Postgres. An answer
/// holding one is a definite `contract_violation`, never `unknown`; an error body
/// holding one is kept readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nul_from_a_provider_is_a_definite_outcome() {
    let Running {
        primary: _primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("", 1).await;

    let answer = submit(&producer, "acct_nul", "answer", "mock:nul").await;
    let job = wait_for_status(&env, answer, JobStatus::Failed).await;
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    assert!(
        error.starts_with("contract_violation") && error.contains("NUL"),
        "{error}"
    );
    // The usage and request id it reported are kept, made storable.
    assert!(job.attempts[0].usage.is_some());
    assert!(job.attempts[0].provider_request_id.is_some());

    let refused = submit(&producer, "acct_nul", "error", "mock:nul mock:status=500").await;
    let job = wait_for_status(&env, refused, JobStatus::Failed).await;
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(
        error.starts_with("provider_error: HTTP 500") && !error.contains('\0'),
        "{error:?}"
    );
    producer.close().await;
    fleet.stop().await;
}

/// Item 12: a provider answer is read up to the provider's `max_response_bytes`
/// and no further; a larger one fails the attempt definitely, so a provider
/// cannot make a worker hold more than that per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_over_max_response_bytes_fails_the_attempt() {
    let Running {
        primary: _primary,
        env,
        fleet,
        producer,
        _file,
    } = Running::start("max_response_bytes = 65536", 1).await;

    let large = submit(&producer, "acct_big", "large", "mock:pad=200000").await;
    let job = wait_for_status(&env, large, JobStatus::Failed).await;
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(
        error.starts_with("provider_error: answer_too_large") && error.contains("65536"),
        "{error}"
    );
    // Within the limit, a large answer is a result like any other.
    let fits = submit(&producer, "acct_big", "fits", "mock:pad=40000").await;
    let job = wait_for_status(&env, fits, JobStatus::Succeeded).await;
    assert!(job.result.unwrap()["summary"].as_str().unwrap().len() > 40_000);
    producer.close().await;
    fleet.stop().await;
}
