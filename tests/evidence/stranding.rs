//! Evidence never strands what it found, reads a listing to its end, and
//! concludes nothing from a call that did not ask for evidence.

use std::time::Duration;

use crate::common::database::Holder;
use crate::common::{P, TestEnv, config, config_for, intent, mock, wait_for, wait_for_status};
use onejob::domain::{AttemptId, AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;
use serde_json::{Value, json};

use super::{evidence_rows, stored, stored_config};

/// Whether `attempt` has an answer kept on it.
async fn kept(env: &TestEnv, attempt: AttemptId) -> bool {
    sqlx::query_scalar("SELECT answer IS NOT NULL FROM attempts WHERE id = $1")
        .bind(attempt.0)
        .fetch_one(env.store.pool())
        .await
        .unwrap()
}

/// A stored answer found while its job row is held (an operator's session, a
/// hedge's settlement) is kept on its attempt before it is settled: the
/// settlement that meets the held row loses nothing, and once the row is
/// free the answer is settled and its kept copy cleared; no second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_found_while_its_job_row_is_held_is_kept_and_settled_once_free() {
    let slow = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(1),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&stored_config(&slow.base_url(), ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-held", "found while held"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let attempt = job.attempts[0].id;
    let held = Holder::hold(&env.database_url, job_id).await;
    wait_for(
        "the found answer to be kept",
        Duration::from_secs(30),
        || async { kept(&env, attempt).await.then_some(()) },
    )
    .await;
    let view = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(view.status, JobStatus::Unknown, "not settled while held");
    held.release().await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "{job:?}");
    assert_eq!(job.completed_by, Some(attempt));
    assert_eq!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: found while held")
    );
    assert!(!kept(&env, attempt).await, "the kept answer is cleared");
    assert_eq!(slow.stats.work(), 1, "the answer was not bought twice");
    assert_eq!(evidence_rows(&env, job_id).await.len(), 1);
    producer.close().await;
    fleet.stop().await;
}

/// Stores a completion at `mock` as another client would, with `metadata`.
async fn store_decoy(mock: &onejob::mock::MockHandle, metadata: Value) {
    let body = json!({
        "model": "m",
        "store": true,
        "metadata": metadata,
        "messages": [{"role": "user", "content": "Summarize: decoy"}],
    });
    let answer = reqwest::Client::new()
        .post(format!("{}/chat/completions", mock.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success());
}

/// A listing is read to its end: with pages of one completion, the first
/// page holds another completion under this attempt's id (another job's)
/// and says it has more; the attempt's own is on the next page, and it
/// settles the attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listing_is_read_to_its_end_page_by_page() {
    let slow = mock(MockOptions {
        store: true,
        list_page: 1,
        delay: Duration::from_millis(800),
        ..MockOptions::default()
    })
    .await;
    // The first look waits 5 s: time to store the decoy before it.
    let text = stored_config(&slow.base_url(), "")
        .replace("evidence_delay = \"1s\"", "evidence_delay = \"5s\"");
    let (config, _file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-pages", "on the second page"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let attempt = job.attempts[0].id.to_string();
    wait_for("the call to be stored", Duration::from_secs(30), || async {
        (!stored(&slow, "onejob_attempt", &attempt).await.is_empty()).then_some(())
    })
    .await;
    let other_job = uuid::Uuid::now_v7().to_string();
    store_decoy(
        &slow,
        json!({ "onejob_attempt": attempt, "onejob_job": other_job }),
    )
    .await;
    let first_page = stored(&slow, "onejob_attempt", &attempt).await;
    assert_eq!(first_page.len(), 1);
    assert_eq!(
        first_page[0]["metadata"]["onejob_job"], other_job,
        "the newest, another job's, comes first"
    );
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "{job:?}");
    assert_eq!(job.attempts[0].status, AttemptStatus::Succeeded);
    assert_eq!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: on the second page")
    );
    producer.close().await;
    fleet.stop().await;
}

/// An unknown whose call asked for no evidence (made before the provider's
/// evidence was switched on) is never failed `no_evidence` once it is: the
/// provider was never asked to store it. It waits for an operator, and no
/// second call is paid for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unknown_whose_call_asked_for_no_evidence_waits_for_an_operator() {
    let slow = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let before = config_for(
        &[P("primary", &slow.base_url(), "timeout = \"500ms\"")],
        "",
    );
    let (plain, _file) = config(&before);
    let env = TestEnv::new(&plain).await;
    let fleet = env.fleet(plain.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-before", "asked for nothing"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let attempt = job.attempts[0].id;
    fleet.stop().await;
    // The provider's evidence is switched on, with a deadline long passed.
    let (keeping, _file) = config(&stored_config(
        &slow.base_url(),
        "evidence_deadline = \"2s\"",
    ));
    let fleet = env.fleet(keeping.clone(), vec![]).await;
    let note = wait_for("a look's note", Duration::from_secs(30), || async {
        let note: Option<String> =
            sqlx::query_scalar("SELECT evidence_note FROM attempts WHERE id = $1")
                .bind(attempt.0)
                .fetch_one(env.store.pool())
                .await
                .unwrap();
        note
    })
    .await;
    assert!(note.contains("asked for no stored evidence"), "{note}");
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown, "{job:?}");
    assert_eq!(job.attempts.len(), 1, "no second call: {job:?}");
    assert_eq!(slow.stats.work(), 1);
    producer.close().await;
    fleet.stop().await;
}
