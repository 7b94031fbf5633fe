//! Resolving an unknown from the console: with a reason, audited, the next
//! attempt planned and published; an attempt that is not unknown cannot be
//! resolved.

use std::time::Duration;

use crate::common::console::{field, serve, two_providers, unknown_job};
use crate::common::{self, TestEnv, config};
use onejob::domain::{AttemptStatus, JobId, JobStatus};
use onejob::edges::store::JobView;
use reqwest::StatusCode;
use reqwest::header::LOCATION;

#[tokio::test]
async fn an_operator_resolves_an_unknown_with_a_reason_and_the_next_attempt_appears() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let served = serve(&env, config, false).await;
    let (job_id, s) = unknown_job(&env.store, "resolve-1").await;
    let session = served.sign_in(&env.store, "ada").await;

    // The unknowns page lists it, with its age and the provider's request id.
    let (status, page) = served.get(&session.cookie, "/unknowns").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains(&s.attempt_id.to_string()) && page.contains("req_console_1"),
        "{page}"
    );
    // And what its provider keeps: no evidence, so an operator resolves it.
    assert!(
        page.contains("keeps none: unknowns wait for an operator"),
        "{page}"
    );

    // The confirmation says what follows: the fallback is not qualified, so
    // the route rule tries the primary again after its backoff.
    let path = format!("/attempts/{}/resolve", s.attempt_id);
    let (status, page) = served
        .get(&session.cookie, &format!("{path}?as=failed"))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("attempt #2 on primary"), "{page}");
    let csrf = field(&page, "csrf");
    assert_eq!(csrf, session.csrf);

    let answer = served
        .post(
            &session.cookie,
            &path,
            &[
                ("as", "failed"),
                ("reason", "provider confirms it never ran"),
                ("csrf", &csrf),
            ],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        answer.headers()[LOCATION],
        format!("/jobs/{job_id}").as_str()
    );

    let (job, _conn) = the_job_runs_again(&env, &ctx, job_id).await;

    // The job's page shows both attempts and the audit row.
    let (status, page) = served
        .get(&session.cookie, &format!("/jobs/{job_id}"))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains(&job.attempts[1].id.to_string()), "{page}");
    assert!(page.contains("provider confirms it never ran") && page.contains("operator:ada"));
    let audit = env.store.audit().of_job(job_id).await.unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].actor, "operator:ada");
    assert_eq!(audit[0].action, "attempt.resolve_failed");
    assert_eq!(audit[0].attempt_id, Some(s.attempt_id.0));
    assert_eq!(
        audit[0].detail["next_attempt"],
        serde_json::json!(job.attempts[1].id)
    );

    // Resolving it again is refused: it is not unknown any more.
    let answer = served
        .post(
            &session.cookie,
            &path,
            &[("as", "cancelled"), ("reason", "twice"), ("csrf", &csrf)],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    let audit = env.store.audit().of_job(job_id).await.unwrap();
    assert_eq!(audit.len(), 1);
}

/// The job runs again: attempt #2 is queued, and its message is on the
/// primary's queue. The job, and the connection that saw the message.
async fn the_job_runs_again(
    env: &TestEnv,
    ctx: &onejob::shared::runtime::Context,
    job_id: JobId,
) -> (JobView, lapin::Connection) {
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Running, "no longer blocked");
    assert_eq!(job.attempts.len(), 2);
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    assert_eq!(job.attempts[1].status, AttemptStatus::Queued);
    assert_eq!(job.attempts[1].provider, "primary");
    // The next attempt takes its turn: the primary's workers hand it out
    // (here, the test does, as no attempt consumer runs).
    assert_eq!(env.hand_out(ctx, "primary").await, 1);
    let conn = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    common::wait_for_depth(
        "the next attempt's message",
        Duration::from_secs(20),
        &ch,
        &onejob::broker::attempts_queue("primary"),
        1,
    )
    .await;
    (job, conn)
}

#[tokio::test]
async fn only_an_unknown_attempt_can_be_resolved_from_the_console() {
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    // An attempt in flight: resolving it would start a second provider call.
    let new = common::new_job("acct_c", "running-1", "running");
    let (job_id, first) = (new.job_id, new.attempt_id);
    env.store.admission().admit(&[new]).await.unwrap();
    env.store
        .settle()
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap();
    let path = format!("/attempts/{first}/resolve");
    let (status, _) = served
        .get(&session.cookie, &format!("{path}?as=failed"))
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    let answer = served
        .post(
            &session.cookie,
            &path,
            &[
                ("as", "failed"),
                ("reason", "hand-made"),
                ("csrf", &session.csrf),
            ],
        )
        .await;
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(job.attempts[0].status, AttemptStatus::Started);
    let audit = env.store.audit().of_job(job_id).await.unwrap();
    assert!(audit.is_empty());
}
