//! Operators keep the last word, and can ask for a look now.

use std::time::Duration;

use crate::common::{TestEnv, config, intent, mock, wait_for, wait_for_status};
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use super::{evidence_rows, stored, stored_config};

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
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Cancelled);
    assert_eq!(job.attempts[0].status, AttemptStatus::Cancelled);
    assert!(evidence_rows(&env, job_id).await.is_empty());
    let gauges = env.store.jobs().gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_unknowns_resolved_last_hour{how=\"operator\"} 1")
            && gauges.contains("onejob_unknowns_resolved_last_hour{how=\"stored\"} 0"),
        "{gauges}"
    );
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
    a_look_needs_a_reason_and_its_audit_row(&env, &file.path, &id, &slow).await;
    let out = env.cli_ok(
        &file.path,
        &["attempts", "evidence", &id, "--reason", "customer asked"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("found: succeeded") && text.contains("settled"),
        "{text}"
    );
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(evidence_rows(&env, job_id).await.len(), 1);
    let (actor, reason, detail): (String, String, serde_json::Value) = sqlx::query_as(
        "SELECT actor, reason, detail FROM audit WHERE action = 'attempt.evidence_look'",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert!(actor.starts_with("cli:"), "{actor}");
    assert_eq!(reason, "customer asked");
    assert_eq!(detail["outcome"], "done", "{detail}");
    assert!(
        detail["found"]
            .as_str()
            .unwrap_or_default()
            .contains("succeeded"),
        "{detail}"
    );
    let out = env.cli_ok(&file.path, &["jobs", "show", &job_id.to_string()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("evidence 1 look(s) (the last at ") && text.contains("): found: succeeded"),
        "{text}"
    );
    // Not unknown any more: nothing to look up.
    let out = env.cli(
        &file.path,
        &["attempts", "evidence", &id, "--json", "--reason", "again"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not unknown"), "{err}");
    producer.close().await;
    fleet.stop().await;
}

/// A look may send a billable request again: it needs a reason, and is
/// recorded before it is taken; with the audit table refusing rows, none is
/// taken.
async fn a_look_needs_a_reason_and_its_audit_row(
    env: &TestEnv,
    path: &std::path::Path,
    id: &str,
    slow: &onejob::mock::MockHandle,
) {
    let out = env.cli(path, &["attempts", "evidence", id]);
    assert_eq!(out.status.code(), Some(2), "no --reason: {out:?}");
    let out = env.cli(path, &["attempts", "evidence", id, "--reason", " "]);
    assert_eq!(out.status.code(), Some(1), "an empty reason: {out:?}");
    let requests = slow.stats.requests();
    crate::common::database::refuse_audit(env).await;
    let out = env.cli(path, &["attempts", "evidence", id, "--reason", "r"]);
    assert_eq!(out.status.code(), Some(1), "unaudited: {out:?}");
    assert_eq!(slow.stats.requests(), requests, "nothing was asked");
    let looks: i32 = sqlx::query_scalar("SELECT evidence_looks FROM attempts WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(looks, 0, "no look was taken");
    sqlx::raw_sql("DROP TRIGGER refuse ON audit")
        .execute(env.store.pool())
        .await
        .unwrap();
}
