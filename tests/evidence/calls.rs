//! Calls that leave evidence, and the mock that keeps it.

use std::time::Duration;

use crate::common::{P, TestEnv, config, config_for, intent, mock, wait_for, wait_for_status};
use futures_util::future::join_all;
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;
use serde_json::{Value, json};

use super::stored;

/// A stored call is kept with its attempt and its job, and found by the
/// attempt: the answer the provider kept is the one the job holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stored_call_is_found_by_its_attempt() {
    let keeps = mock(MockOptions {
        store: true,
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&config_for(
        &[P("primary", &keeps.base_url(), "evidence = \"stored\"")],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-stored", "keep me"))
        .await
        .unwrap();
    let job_id = receipt.job_id.expect("a job");
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    let attempt = &job.attempts[0];
    let found = stored(&keeps, "onejob_attempt", &attempt.id.to_string()).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["metadata"]["onejob_job"], job_id.to_string());
    assert_eq!(
        found[0]["id"].as_str(),
        attempt.provider_request_id.as_deref()
    );
    let content = found[0]["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    let kept: Value = serde_json::from_str(content).unwrap();
    assert_eq!(Some(&kept), job.result.as_ref());
    // Another attempt's metadata finds nothing.
    let other = uuid::Uuid::now_v7().to_string();
    assert!(stored(&keeps, "onejob_attempt", &other).await.is_empty());
    producer.close().await;
    fleet.stop().await;
}

/// With `evidence = "none"` (the default), no call is asked to be kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_provider_without_stored_evidence_is_asked_to_keep_nothing() {
    let plain = mock(MockOptions {
        store: true,
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&config_for(&[P("primary", &plain.base_url(), "")], ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-plain", "keep me not"))
        .await
        .unwrap();
    let job = wait_for_status(&env, receipt.job_id.unwrap(), JobStatus::Succeeded).await;
    let id = job.attempts[0].id.to_string();
    assert!(stored(&plain, "onejob_attempt", &id).await.is_empty());
    assert_eq!(plain.stats.idempotency_keys(), vec![id]);
    producer.close().await;
    fleet.stop().await;
}

/// A call onejob stopped waiting for (its attempt `unknown`) is still kept by
/// a provider that stores: the evidence an unknown is settled from.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_onejob_stopped_waiting_for_is_still_kept() {
    let slow = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&config_for(
        &[P(
            "primary",
            &slow.base_url(),
            "timeout = \"500ms\"\nevidence = \"stored\"",
        )],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-slow", "slow one"))
        .await
        .unwrap();
    let job = wait_for_status(&env, receipt.job_id.unwrap(), JobStatus::Unknown).await;
    let attempt = &job.attempts[0];
    assert_eq!(attempt.status, AttemptStatus::Unknown);
    let id = attempt.id.to_string();
    let found = wait_for("the call to be kept", Duration::from_secs(30), || async {
        let found = stored(&slow, "onejob_attempt", &id).await;
        (!found.is_empty()).then_some(found)
    })
    .await;
    assert_eq!(found.len(), 1);
    assert_eq!(found[0]["metadata"]["onejob_job"], job.id.to_string());
    assert_eq!(slow.stats.work(), 1, "the call ran once");
    producer.close().await;
    fleet.stop().await;
}

/// The mock's idempotency keys, as the IETF Idempotency-Key draft has them:
/// a repeated key runs no new work; it is answered `409` while the first
/// request is still running, then with the first request's outcome, its
/// answer or its error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mock_replays_a_repeated_key_without_new_work() {
    let replays = mock(MockOptions {
        replay: true,
        ..MockOptions::default()
    })
    .await;
    let http = reqwest::Client::new();
    let url = format!("{}/chat/completions", replays.base_url());
    let call = |key: &'static str, text: &'static str| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let body = json!({"model": "m", "messages": [{"role": "user", "content": text}]});
            let r = http
                .post(url)
                .header("Idempotency-Key", key)
                .json(&body)
                .send()
                .await
                .expect("an answer");
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    // Three at once, the first still running when the others arrive: one
    // runs, the others are told it is still being processed.
    let answers = join_all([
        call("k-1", "mock:delay=500 first"),
        call("k-1", "mock:delay=500 first"),
        call("k-1", "mock:delay=500 first"),
    ])
    .await;
    let ran: Vec<_> = answers.iter().filter(|a| a.0 == 200).collect();
    assert_eq!(ran.len(), 1, "{answers:?}");
    let busy: Vec<_> = answers.iter().filter(|a| a.0 == 409).collect();
    assert_eq!(busy.len(), 2, "{answers:?}");
    assert!(busy[0].1.contains("still being processed"), "{answers:?}");
    assert_eq!(replays.stats.requests(), 3);
    assert_eq!(replays.stats.work(), 1, "one request's work ran");
    // Later, the first answer again.
    assert_eq!(&call("k-1", "mock:delay=500 first").await, ran[0]);
    assert_eq!(replays.stats.work(), 1);
    // A first request that failed: its key is answered with its failure, with
    // no new work.
    let failed = call("k-2", "mock:status=500").await;
    assert_eq!(failed.0, 500);
    assert_eq!(call("k-2", "mock:status=500").await, failed);
    assert_eq!(replays.stats.work(), 2);
}
