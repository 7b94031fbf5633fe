//! Qualification tests the evidence claim: a provider said to store its calls
//! must have a test call found by its metadata, one said to replay keys must
//! answer a repeated key with the first answer. A claim found false turns
//! evidence off for that provider (its unknowns wait for an operator, and
//! `providers list` says why) until a later qualification finds it holds.

use std::time::Duration;

use crate::common::{P, TestEnv, config, config_for, intent, mock, wait_for, wait_for_status};
use onejob::domain::JobStatus;
use onejob::mock::MockOptions;
use onejob_producer::Producer;
use serde_json::Value;

use super::stored_config;

/// `providers list --json`'s evidence for `provider`.
fn evidence_of(env: &TestEnv, file: &std::path::Path, provider: &str) -> Value {
    let out = env.cli_ok(file, &["providers", "list", "--json"]);
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .find(|p| p["provider"] == provider)
        .map(|p| p["evidence"].clone())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_false_stored_claim_turns_evidence_off_until_it_holds() {
    // The provider is said to store its calls, but keeps nothing.
    let forgetful = mock(MockOptions::default()).await;
    let (config, file) = config(&stored_config(&forgetful.base_url(), ""));
    let env = TestEnv::new(&config).await;
    assert_eq!(
        evidence_of(&env, &file.path, "primary")["state"],
        "unchecked"
    );
    let out = env.cli_ok(&file.path, &["providers", "qualify", "primary"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("QUALIFIED") && text.contains("evidence stored: off"),
        "{text}"
    );
    let evidence = evidence_of(&env, &file.path, "primary");
    assert_eq!(evidence["state"], "off", "{evidence}");
    assert!(
        evidence["why"]
            .as_str()
            .unwrap()
            .contains("could not be listed"),
        "{evidence}"
    );

    // Its unknowns are not looked up, and an operator's look is refused.
    forgetful.configure(|o| o.delay = Duration::from_secs(1));
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let receipt = producer
        .submit(&intent("acct_ev", "k-claim", "claim off"))
        .await
        .unwrap();
    let job = wait_for_status(&env, receipt.job_id.unwrap(), JobStatus::Unknown).await;
    let attempt = job.attempts[0].id;
    let looks = || async {
        let n: i32 = sqlx::query_scalar("SELECT evidence_looks FROM attempts WHERE id = $1")
            .bind(attempt.0)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
        n
    };
    // Past the first look's time, and a few passes more.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(looks().await, 0, "no look while the claim is false");
    let out = env.cli(
        &file.path,
        &[
            "attempts",
            "evidence",
            &attempt.to_string(),
            "--reason",
            "claim off",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("evidence is off for provider primary"),
        "{err}"
    );

    // It stores now: a qualification finds the claim holds, and looks resume.
    forgetful.configure(|o| {
        o.store = true;
        o.delay = Duration::ZERO;
    });
    env.cli_ok(&file.path, &["providers", "qualify", "primary"]);
    assert_eq!(evidence_of(&env, &file.path, "primary")["state"], "on");
    wait_for("a look", Duration::from_secs(30), || async {
        (looks().await > 0).then_some(())
    })
    .await;
    producer.close().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_claim_holds_only_where_a_repeated_key_runs_no_new_work() {
    let plain = mock(MockOptions::default()).await;
    let replays = mock(MockOptions {
        replay: true,
        ..MockOptions::default()
    })
    .await;
    let (config, file) = config(&config_for(
        &[
            P(
                "primary",
                &plain.base_url(),
                "evidence = \"idempotency_key\"",
            ),
            P(
                "fallback",
                &replays.base_url(),
                "evidence = \"idempotency_key\"",
            ),
        ],
        "",
    ));
    let env = TestEnv::new(&config).await;
    env.cli_ok(&file.path, &["providers", "qualify", "primary"]);
    env.cli_ok(&file.path, &["providers", "qualify", "fallback"]);
    let primary = evidence_of(&env, &file.path, "primary");
    assert_eq!(primary["state"], "off", "{primary}");
    assert!(
        primary["why"].as_str().unwrap().contains("ran new work"),
        "{primary}"
    );
    let fallback = evidence_of(&env, &file.path, "fallback");
    assert_eq!(fallback["state"], "on", "{fallback}");
    // The plain text says the same.
    let out = env.cli_ok(&file.path, &["providers", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("evidence idempotency_key: off")
            && text.contains("evidence idempotency_key: on"),
        "{text}"
    );
}

/// A provider whose answers carry no response id cannot show that it kept
/// or replayed an answer: two missing ids are not the same answer. Its claim
/// fails with the reason, whichever kind it claims (a provider that ignores
/// the key would otherwise pass, and every later re-send buy new work).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_whose_answers_carry_no_id_fails_with_the_reason() {
    let anonymous = mock(MockOptions {
        store: true,
        ..MockOptions::default()
    })
    .await;
    let text = config_for(
        &[
            P(
                "primary",
                &anonymous.base_url(),
                "evidence = \"idempotency_key\"",
            ),
            P(
                "fallback",
                &anonymous.base_url(),
                "evidence = \"stored\"\nevidence_delay = \"100ms\"",
            ),
        ],
        "",
    )
    .replace(
        "The quick brown fox jumps over the lazy dog.",
        "mock:no_id The quick brown fox.",
    );
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    for provider in ["primary", "fallback"] {
        env.cli_ok(&file.path, &["providers", "qualify", provider]);
        let evidence = evidence_of(&env, &file.path, provider);
        assert_eq!(evidence["state"], "off", "{provider}: {evidence}");
        assert!(
            evidence["why"]
                .as_str()
                .unwrap()
                .contains("carries no response id"),
            "{provider}: {evidence}"
        );
    }
}
