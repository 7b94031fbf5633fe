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
    let view = env.store.jobs().job(job_id).await.unwrap().unwrap();
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
    // Settled by the kept-answer pass, not by the look: the attempt still
    // says what its look found.
    let note = job.attempts[0].evidence_note.as_deref().unwrap_or_default();
    assert!(note.contains("succeeded"), "{note:?}");
    assert!(job.attempts[0].evidence_last_at.is_some());
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
    let before = config_for(&[P("primary", &slow.base_url(), "timeout = \"500ms\"")], "");
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
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Unknown, "{job:?}");
    assert_eq!(job.attempts.len(), 1, "no second call: {job:?}");
    assert_eq!(slow.stats.work(), 1);
    producer.close().await;
    fleet.stop().await;
}

/// One slow provider's looks (each may wait a whole timeout: here a
/// listing that never answers) do not delay another provider's: the fast
/// provider's unknown is settled while the slow provider's first looks are
/// still waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_providers_looks_do_not_delay_another_providers() {
    let silent_url = silent_provider().await;
    let fast = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(1),
        ..MockOptions::default()
    })
    .await;
    let keeping = "evidence = \"stored\"\nevidence_delay = \"1s\"";
    let (config, _file) = config(&config_for(
        &[
            P(
                "silent",
                &silent_url,
                &format!("timeout = \"10s\"\n{keeping}"),
            ),
            P(
                "fast",
                &fast.base_url(),
                &format!("timeout = \"500ms\"\n{keeping}"),
            ),
        ],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let pinned = |key: &str, provider: &str| {
        let mut i = intent("acct_ev", key, key);
        i.provider = Some(provider.into());
        i
    };
    let mut silent_attempts = Vec::new();
    for key in ["k-silent-1", "k-silent-2"] {
        let receipt = producer.submit(&pinned(key, "silent")).await.unwrap();
        let job = wait_for_status(&env, receipt.job_id.unwrap(), JobStatus::Unknown).await;
        silent_attempts.push(job.attempts[0].id.0);
    }
    // (looks begun, looks ended) over the silent provider's unknowns.
    let silent_looks = || async {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT count(*) FILTER (WHERE evidence_looks > 0),
                    count(*) FILTER (WHERE evidence_last_at IS NOT NULL)
             FROM attempts WHERE id = ANY($1)",
        )
        .bind(&silent_attempts)
        .fetch_one(env.store.pool())
        .await
        .unwrap()
    };
    wait_for(
        "a look at the silent provider",
        Duration::from_secs(30),
        || async { (silent_looks().await.0 > 0).then_some(()) },
    )
    .await;
    let receipt = producer.submit(&pinned("k-fast", "fast")).await.unwrap();
    let job = wait_for_status(&env, receipt.job_id.unwrap(), JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "settled from evidence: {job:?}");
    assert_eq!(fast.stats.work(), 1);
    let (begun, ended) = silent_looks().await;
    assert!(begun > 0);
    assert_eq!(
        ended, 0,
        "the fast provider's unknown was settled while the silent provider's looks still waited"
    );
    producer.close().await;
    fleet.stop().await;
}

/// A provider that drops every call once it has read it (the call is
/// `unknown` at once) and never answers a listing (a look waits its whole
/// timeout): its base URL.
async fn silent_provider() -> String {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", silent.local_addr().unwrap());
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut waiting = Vec::new();
        while let Ok((mut conn, _)) = silent.accept().await {
            let mut head = [0u8; 4];
            if conn.read_exact(&mut head).await.is_ok() && &head == b"GET " {
                waiting.push(conn);
            } else {
                let mut rest = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_millis(50), conn.read(&mut rest)).await;
                drop(conn);
            }
        }
    });
    url
}
