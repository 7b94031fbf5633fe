//! The pass over stored completions: found, not found by the deadline,
//! two pods at once.

use std::time::Duration;

use crate::common::{P, TestEnv, config, intent, mock, wait_for, wait_for_status};
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;
use serde_json::json;

use super::{evidence_rows, stored, stored_config};

/// A call that timed out, which the provider completed and stored, settles
/// its attempt with no operator: the job succeeds with the stored answer, its
/// usage is kept, the provider ran the work once, and the resolution is
/// audited with the actor `evidence`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unknown_is_settled_from_the_completion_the_provider_kept() {
    let slow = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&stored_config(&slow.base_url(), ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-settled", "settle me"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "no second attempt: {job:?}");
    let attempt = &job.attempts[0];
    assert_eq!(attempt.status, AttemptStatus::Succeeded);
    assert!(attempt.usage.is_some(), "usage kept: {attempt:?}");
    let found = stored(&slow, "onejob_attempt", &attempt.id.to_string()).await;
    assert_eq!(
        found[0]["id"].as_str(),
        attempt.provider_request_id.as_deref()
    );
    assert_eq!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: settle me")
    );
    assert_eq!(slow.stats.work(), 1, "the provider ran the work once");
    let rows = evidence_rows(&env, job_id).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].action, "attempt.evidence");
    assert_eq!(rows[0].detail["evidence"], "found");
    // Counted: the look, the resolution and its time, and the hour's gauge.
    let metrics = onejob::edges::metrics::render();
    for line in [
        "onejob_unknowns_resolved_total{how=\"stored\"} 1",
        "onejob_unknown_resolution_seconds_count{how=\"stored\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
    assert!(
        metrics.contains("onejob_evidence_looks_total{provider=\"primary\",outcome=\"stored\"} 1"),
        "{metrics}"
    );
    let gauges = env.store.jobs().gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_unknowns_resolved_last_hour{how=\"stored\"} 1"),
        "{gauges}"
    );
    producer.close().await;
    fleet.stop().await;
}

/// A call the provider never completed leaves no stored completion: by
/// `evidence_deadline` the attempt fails `no_evidence` and the route moves
/// on. A completion stored with this attempt's id but another job's is not
/// taken. While the provider cannot be asked, it is asked again later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_evidence_by_the_deadline_fails_the_attempt_and_the_route_moves_on() {
    let primary = mock(MockOptions {
        store: true,
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&stored_config(
        &primary.base_url(),
        "evidence_deadline = \"4s\"",
    ));
    let env = TestEnv::new(&config).await;
    // The connection drops mid-answer: unknown, and nothing stored.
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-none", "mock:drop nothing kept"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let first = job.attempts[0].id;
    // Another job's completion under this attempt's id, planted.
    let planted = reqwest::Client::new()
        .post(format!("{}/chat/completions", primary.base_url()))
        .json(&json!({
            "model": "m", "store": true,
            "metadata": {"onejob_attempt": first.to_string(), "onejob_job": uuid::Uuid::now_v7().to_string()},
            "messages": [{"role": "user", "content": "planted"}],
        }))
        .send()
        .await
        .unwrap();
    assert!(planted.status().is_success());
    // The provider's listing is down for a while: looked at again later.
    primary.configure(|o| o.store = false);
    wait_for(
        "a look that could not ask",
        Duration::from_secs(30),
        || async {
            let note: Option<String> =
                sqlx::query_scalar("SELECT evidence_note FROM attempts WHERE id = $1")
                    .bind(first.0)
                    .fetch_one(env.store.pool())
                    .await
                    .unwrap();
            note.filter(|n| n.contains("could not be asked"))
                .map(|_| ())
        },
    )
    .await;
    primary.configure(|o| {
        o.store = true;
        o.directives = false;
    });
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 2, "{job:?}");
    let a = &job.attempts[0];
    assert_eq!(a.status, AttemptStatus::Failed);
    assert!(
        a.error
            .as_deref()
            .is_some_and(|e| e.starts_with("no_evidence")),
        "{a:?}"
    );
    assert_ne!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: planted"),
        "another job's completion was taken"
    );
    let rows = evidence_rows(&env, job_id).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].detail["evidence"], "not found");
    producer.close().await;
    fleet.stop().await;
}

/// Two pods run the pass at once: each unknown is settled once, by one of
/// them, and each provider call ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_pods_settle_each_unknown_once() {
    let slow = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(1),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&stored_config(&slow.base_url(), ""));
    let env = TestEnv::new(&config).await;
    let fleets = [
        env.fleet(config.clone(), vec![]).await,
        env.fleet(config.clone(), vec![]).await,
    ];
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let mut jobs = Vec::new();
    for i in 0..12 {
        let receipt = producer
            .submit(&intent(
                "acct_ev",
                &format!("k-two-{i}"),
                &format!("two pods {i}"),
            ))
            .await
            .unwrap();
        jobs.push(receipt.job_id.unwrap());
    }
    for job_id in &jobs {
        let job = wait_for_status(&env, *job_id, JobStatus::Succeeded).await;
        assert_eq!(job.attempts.len(), 1, "{job:?}");
        assert_eq!(evidence_rows(&env, *job_id).await.len(), 1, "{job_id}");
    }
    assert_eq!(slow.stats.work(), 12, "each call ran once");
    producer.close().await;
    for fleet in fleets {
        fleet.stop().await;
    }
}

/// Evidence found after the job ended: the primary's call times out (its
/// attempt `unknown`) while a hedge started before it is still running; the
/// hedge wins, and the unknown attempt is `discarded`. Its stored answer,
/// found later, tells what its call cost: the usage is kept on it (a paid
/// answer is never thrown away), it stays discarded, and the job's result
/// stays the hedge's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn evidence_found_after_the_job_ended_is_discarded_with_its_usage() {
    let primary = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(3),
        tag: Some("primary".into()),
        ..MockOptions::default()
    })
    .await;
    let fallback = mock(MockOptions {
        delay: Duration::from_millis(1500),
        tag: Some("fallback".into()),
        ..MockOptions::default()
    })
    .await;
    let text = crate::common::config_for(
        &[
            P(
                "primary",
                &primary.base_url(),
                "timeout = \"1500ms\"\nevidence = \"stored\"\nevidence_delay = \"1s\"",
            ),
            P("fallback", &fallback.base_url(), "timeout = \"10s\""),
        ],
        "hedge_after = \"200ms\"",
    );
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    env.cli_ok(&file.path, &["providers", "qualify", "fallback"]);
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-late", "found late"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert!(
        job.result.as_ref().unwrap()["summary"]
            .as_str()
            .unwrap()
            .contains("from fallback"),
        "{job:?}"
    );
    let first = job.attempts[0].clone();
    assert_eq!(first.provider, "primary");
    let job = wait_for(
        "the evidence of its cost",
        Duration::from_secs(30),
        || async {
            let j = env.store.jobs().job(job_id).await.unwrap().unwrap();
            j.attempts[0].usage.is_some().then_some(j)
        },
    )
    .await;
    let a = &job.attempts[0];
    assert_eq!(a.status, AttemptStatus::Discarded, "{a:?}");
    let found = stored(&primary, "onejob_attempt", &a.id.to_string()).await;
    assert_eq!(found[0]["id"].as_str(), a.provider_request_id.as_deref());
    assert!(
        job.result.as_ref().unwrap()["summary"]
            .as_str()
            .unwrap()
            .contains("from fallback"),
        "the result stays the hedge's: {job:?}"
    );
    let rows = evidence_rows(&env, job_id).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(primary.stats.work(), 1);
    producer.close().await;
    fleet.stop().await;
}

/// Issue 40, item 6: a job cancelled while its attempt is `unknown`. The call
/// may have run, and been paid for: the attempt is `discarded` (not
/// `cancelled`, which no evidence looks at), and the answer its provider
/// stored, found later, tells what it cost; the usage is kept on it and
/// counted against the owner. The job stays cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unknown_whose_job_is_cancelled_has_its_cost_found() {
    cancelled_unknown_costs(None).await;
}

/// Issue 40, item 6: the same, where the answer the provider stored breaks
/// the output contract: it was paid for all the same, and its usage counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stored_answer_that_breaks_the_contract_still_tells_its_cost() {
    cancelled_unknown_costs(Some(onejob::mock::Misbehaviour::Prose)).await;
}

/// A job cancelled while its attempt is `unknown`, against a provider that
/// stores its completions (answering as `misbehave` says): the attempt is
/// discarded, and the cost evidence finds is kept and counted.
async fn cancelled_unknown_costs(misbehave: Option<onejob::mock::Misbehaviour>) {
    let primary = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(2),
        misbehave,
        ..MockOptions::default()
    })
    .await;
    let (config, file) = config(&super::stored_config(&primary.base_url(), ""));
    let env = TestEnv::new(&config).await;
    // A budget: the call's reservation lasts while its cost may still come.
    env.cli_ok(
        &file.path,
        &[
            "owners",
            "set",
            "acct_cancel",
            "--daily-tokens",
            "100000",
            "--reason",
            "test",
        ],
    );
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_cancel", "k", "cancelled unknown"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    wait_for_status(&env, job_id, JobStatus::Unknown).await;
    env.cli_ok(&file.path, &["jobs", "cancel", &job_id.to_string()]);
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded, "{job:?}");
    let held = env
        .store
        .owners()
        .owner("acct_cancel")
        .await
        .unwrap()
        .reserved;
    assert!(held > 0, "discarded, its call still holds its reservation");
    let job = wait_for(
        "the evidence of its cost",
        Duration::from_secs(30),
        || async {
            let j = env.store.jobs().job(job_id).await.unwrap().unwrap();
            j.attempts[0].usage.is_some().then_some(j)
        },
    )
    .await;
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Discarded);
    let owner = env.store.owners().owner("acct_cancel").await.unwrap();
    assert!(
        owner.spent_24h > 0,
        "its cost counts against the owner: {owner:?}"
    );
    assert_eq!(owner.reserved, 0, "its usage replaced its reservation");
    producer.close().await;
    fleet.stop().await;
}

/// Issue 40, item 6: a call that times out after its job was cancelled. Its
/// attempt is `discarded` (nothing is blocked any more), and evidence looks
/// for what the call cost, as for any discarded attempt whose outcome was
/// not known: the stored answer found later puts its usage on the attempt,
/// counted against the owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_after_its_job_was_cancelled_has_its_cost_found() {
    let primary = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(3),
        ..MockOptions::default()
    })
    .await;
    let provider = "timeout = \"2s\"\nevidence = \"stored\"\nevidence_delay = \"1s\"";
    let text = crate::common::config_for(&[P("primary", &primary.base_url(), provider)], "");
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_late", "k", "cancelled mid-call"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    wait_for_status(&env, job_id, JobStatus::Running).await;
    env.cli_ok(&file.path, &["jobs", "cancel", &job_id.to_string()]);
    let job = wait_for("the timeout", Duration::from_secs(20), || async {
        let j = env.store.jobs().job(job_id).await.unwrap().unwrap();
        (j.attempts[0].status == AttemptStatus::Discarded).then_some(j)
    })
    .await;
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(error.contains("after its job had ended"), "{error}");
    wait_for(
        "the evidence of its cost",
        Duration::from_secs(30),
        || async {
            let j = env.store.jobs().job(job_id).await.unwrap().unwrap();
            j.attempts[0].usage.is_some().then_some(())
        },
    )
    .await;
    let spent = env
        .store
        .owners()
        .owner("acct_late")
        .await
        .unwrap()
        .spent_24h;
    assert!(spent > 0, "its cost counts against the owner: {spent}");
    producer.close().await;
    fleet.stop().await;
}
