//! Calls that leave evidence (contract section 7, Evidence): a provider whose
//! evidence is `stored` is asked to keep each call with its attempt and job as
//! metadata, and keeps it even when onejob stopped waiting; the bundled mock
//! keeps both kinds of evidence, stored completions and answers replayed by
//! idempotency key, and counts the work it ran apart from the requests.

mod common;

use std::time::Duration;

use common::{P, TestEnv, config, config_for, intent, mock, wait_for, wait_for_status};
use futures_util::future::join_all;
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::{MockHandle, MockOptions};
use onejob_producer::Producer;
use serde_json::{Value, json};

/// The stored completions the mock lists for `metadata[key]=value`.
async fn stored(mock: &MockHandle, key: &str, value: &str) -> Vec<Value> {
    let query = url::form_urlencoded::Serializer::new(String::new())
        .append_pair(&format!("metadata[{key}]"), value)
        .finish();
    let list: Value = reqwest::Client::new()
        .get(format!("{}/chat/completions?{query}", mock.base_url()))
        .send()
        .await
        .expect("the mock answers")
        .json()
        .await
        .expect("a list");
    list["data"].as_array().cloned().unwrap_or_default()
}

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

/// The mock's idempotency keys: a repeated key runs no new work and is
/// answered with the first request's answer, waiting for it if it is still
/// running; a key whose first request ended without an answer is `409`.
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
    // Three at once, the first still running when the others arrive.
    let answers = join_all([
        call("k-1", "mock:delay=500 first"),
        call("k-1", "mock:delay=500 first"),
        call("k-1", "mock:delay=500 first"),
    ])
    .await;
    assert!(answers.iter().all(|a| a == &answers[0]), "{answers:?}");
    assert_eq!(answers[0].0, 200);
    assert_eq!(replays.stats.requests(), 3);
    assert_eq!(replays.stats.work(), 1, "one request's work ran");
    // Later, the same again.
    assert_eq!(call("k-1", "mock:delay=500 first").await, answers[0]);
    assert_eq!(replays.stats.work(), 1);
    // A first request that failed: its key is answered 409, with no new work.
    let failed = call("k-2", "mock:status=500").await;
    assert_eq!(failed.0, 500);
    let again = call("k-2", "mock:status=500").await;
    assert_eq!(again.0, 409, "{again:?}");
    assert!(again.1.contains("did not complete"), "{again:?}");
    assert_eq!(replays.stats.work(), 2);
}

/// The configuration of one provider `primary` at `base` that stores its
/// calls, with a short timeout and `extra` lines.
fn stored_config(base: &str, extra: &str) -> String {
    config_for(
        &[P(
            "primary",
            base,
            &format!(
                "timeout = \"500ms\"\nevidence = \"stored\"\nevidence_delay = \"1s\"\n{extra}"
            ),
        )],
        "",
    )
}

/// The evidence audit rows of a job.
async fn evidence_rows(
    env: &TestEnv,
    job: onejob::domain::JobId,
) -> Vec<onejob::store::AuditEntry> {
    env.store
        .audit_of_job(job)
        .await
        .unwrap()
        .into_iter()
        .filter(|a| a.actor == "evidence")
        .collect()
}

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
    let metrics = onejob::metrics::render();
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
    let gauges = env.store.gauges().await.unwrap();
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

/// An operator who resolves an unknown before its evidence is looked at has
/// the last word: the stored answer, found later, changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_resolving_first_wins() {
    let slow = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(1),
        ..MockOptions::default()
    })
    .await;
    let text = stored_config(&slow.base_url(), "")
        .replace("evidence_delay = \"1s\"", "evidence_delay = \"4s\"");
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-operator", "operator first"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let first = job.attempts[0].id.to_string();
    env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &first,
            "--as",
            "cancelled",
            "--reason",
            "looked myself",
        ],
    );
    // The stored answer exists, and the evidence delay passes.
    wait_for("the call to be kept", Duration::from_secs(30), || async {
        (!stored(&slow, "onejob_attempt", &first).await.is_empty()).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let job = env.store.job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Cancelled);
    assert!(evidence_rows(&env, job_id).await.is_empty());
    let gauges = env.store.gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_unknowns_resolved_last_hour{how=\"operator\"} 1")
            && gauges.contains("onejob_unknowns_resolved_last_hour{how=\"stored\"} 0"),
        "{gauges}"
    );
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

/// The configuration of one provider `primary` at `base` that replays a
/// repeated idempotency key.
fn replay_config(base: &str) -> String {
    config_for(
        &[P(
            "primary",
            base,
            "timeout = \"500ms\"\nevidence = \"idempotency_key\"\nevidence_delay = \"1s\"",
        )],
        "",
    )
}

/// With `idempotency_key` evidence, an unknown call is sent again with the
/// same key: the provider answers with the first call's answer and runs
/// nothing new, and that answer settles the attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repeated_key_settles_an_unknown_with_the_first_answer() {
    let slow = mock(MockOptions {
        replay: true,
        delay: Duration::from_secs(2),
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&replay_config(&slow.base_url()));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-replay", "replay me"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1, "{job:?}");
    let attempt = &job.attempts[0];
    assert_eq!(attempt.status, AttemptStatus::Succeeded);
    assert_eq!(
        job.result.as_ref().and_then(|r| r["summary"].as_str()),
        Some("mock answer: Summarize: replay me")
    );
    assert_eq!(slow.stats.work(), 1, "the work ran once");
    assert!(slow.stats.requests() >= 2, "sent again");
    let keys = slow.stats.idempotency_keys();
    assert!(
        keys.iter().all(|k| *k == attempt.id.to_string()),
        "{keys:?}"
    );
    let rows = evidence_rows(&env, job_id).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].detail["evidence"], "replayed");
    producer.close().await;
    fleet.stop().await;
}

/// A `409` for the key (the first call did not complete) is a definite
/// failure: the attempt fails and the route moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_409_for_the_key_fails_the_attempt_and_the_route_moves_on() {
    let primary = mock(MockOptions {
        replay: true,
        ..MockOptions::default()
    })
    .await;
    let (config, _file) = config(&replay_config(&primary.base_url()));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-409", "mock:drop never completed"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    wait_for_status(&env, job_id, JobStatus::Unknown).await;
    primary.configure(|o| o.directives = false);
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 2, "{job:?}");
    let first = &job.attempts[0];
    assert_eq!(first.status, AttemptStatus::Failed);
    assert!(
        first
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("not_completed") && e.contains("409")),
        "{first:?}"
    );
    assert_eq!(
        primary.stats.work(),
        2,
        "the dropped call and the next attempt's"
    );
    let rows = evidence_rows(&env, job_id).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].detail["evidence"], "not completed");
    producer.close().await;
    fleet.stop().await;
}

/// An operator asks for a look now (`onejob attempts evidence`): the stored
/// answer settles the attempt, and `jobs show` says what was found. Asked of
/// an attempt that is not unknown, it refuses, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_looks_now_and_sees_what_was_found() {
    let slow = mock(MockOptions {
        store: true,
        delay: Duration::from_secs(1),
        ..MockOptions::default()
    })
    .await;
    // A long delay: the pass will not look before the operator does.
    let text = stored_config(&slow.base_url(), "")
        .replace("evidence_delay = \"1s\"", "evidence_delay = \"5m\"");
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-now", "look now"))
        .await
        .unwrap();
    let job_id = receipt.job_id.unwrap();
    let job = wait_for_status(&env, job_id, JobStatus::Unknown).await;
    let id = job.attempts[0].id.to_string();
    wait_for("the call to be kept", Duration::from_secs(30), || async {
        (!stored(&slow, "onejob_attempt", &id).await.is_empty()).then_some(())
    })
    .await;
    let out = env.cli_ok(&file.path, &["attempts", "evidence", &id]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("found: succeeded") && text.contains("settled"),
        "{text}"
    );
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(evidence_rows(&env, job_id).await.len(), 1);
    let out = env.cli_ok(&file.path, &["jobs", "show", &job_id.to_string()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("evidence 1 look(s): found: succeeded"),
        "{text}"
    );
    // Not unknown any more: nothing to look up.
    let out = env.cli(&file.path, &["attempts", "evidence", &id, "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not unknown"), "{err}");
    producer.close().await;
    fleet.stop().await;
}
