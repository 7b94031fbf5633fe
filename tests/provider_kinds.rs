//! Each kind of provider end to end, through the real RabbitMQ and Postgres,
//! with the bundled mock answering in the kind's wire format: a job on
//! Anthropic's Messages API with its usage spent, a route that fails over
//! from one kind to the other under the same qualification rule, and a
//! qualification that goes stale when its provider's kind changes. (What
//! each kind's wire format keeps of the transport's guarantees is the
//! conformance suite's, in `src/edges/provider/conformance.rs`.)

use onejob_test_support as common;

use common::{P, TestEnv, config, config_for, mock, submit, wait_for_status};
use onejob::domain::{AttemptStatus, JobStatus};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

const ANTHROPIC: &str = "kind = \"anthropic\"";

/// Each provider's qualification state, from `onejob providers list --json`.
fn qualification(env: &TestEnv, file: &std::path::Path, provider: &str) -> (String, bool) {
    let out = env.cli_ok(file, &["providers", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = list
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["provider"] == provider)
        .unwrap();
    let op = &p["operations"][0];
    (
        op["qualification"].as_str().unwrap().to_owned(),
        op["eligible"] == true,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_runs_on_an_anthropic_provider_and_its_usage_is_spent() {
    let provider = mock(MockOptions::default()).await;
    let url = provider.base_url();
    let (cfg, _file) = config(&config_for(&[P("claude", &url, ANTHROPIC)], ""));
    let env = TestEnv::new(&cfg).await;
    let fleet = env.fleet(cfg.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job_id = submit(&producer, "acct_kind", "k-1", "messages api").await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    let summary = job.result.unwrap()["summary"].as_str().unwrap().to_owned();
    assert!(summary.contains("messages api"), "{summary}");
    let attempt = &job.attempts[0];
    assert_eq!(attempt.status, AttemptStatus::Succeeded);
    assert!(
        attempt
            .provider_request_id
            .as_deref()
            .unwrap()
            .starts_with("msg_"),
        "answered on the Messages API route: {attempt:?}"
    );
    // Its usage as Anthropic names it, counted in the owner's spend.
    let (usage, spent): (serde_json::Value, i64) = sqlx::query_as(
        "SELECT a.usage, (SELECT sum(tokens)::int8 FROM owner_spend WHERE owner_id = 'acct_kind')
         FROM attempts a WHERE a.job_id = $1",
    )
    .bind(job_id.0)
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    let (input, output) = (
        usage["input_tokens"].as_i64().unwrap(),
        usage["output_tokens"].as_i64().unwrap(),
    );
    assert!(input > 0 && output == 12, "{usage}");
    assert_eq!(spent, input + output);
    assert_eq!(provider.stats.requests(), 1);

    producer.close().await;
    fleet.stop().await;
}

/// `["anthropic-main", "openai-backup"]`: the Anthropic primary fails
/// definitely (503 on every call); the OpenAI backup takes the failover only
/// once it is qualified, as any failover target.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_route_fails_over_across_kinds_under_the_same_qualification_rule() {
    let main = mock(MockOptions {
        error_rate: 1.0,
        ..MockOptions::default()
    })
    .await;
    let backup = mock(MockOptions {
        tag: Some("backup".into()),
        ..MockOptions::default()
    })
    .await;
    let (main_url, backup_url) = (main.base_url(), backup.base_url());
    let (cfg, file) = config(&config_for(
        &[
            P("anthropic-main", &main_url, ANTHROPIC),
            P("openai-backup", &backup_url, ""),
        ],
        "",
    ));
    let env = TestEnv::new(&cfg).await;
    let fleet = env.fleet(cfg.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    // Unqualified, the backup is never called: every attempt goes to the main.
    let refused = submit(&producer, "acct_route", "k-1", "before").await;
    let job = wait_for_status(&env, refused, JobStatus::Failed).await;
    assert_eq!(job.attempts.len(), 3);
    assert!(
        job.attempts.iter().all(|a| a.provider == "anthropic-main"),
        "{:?}",
        job.attempts
    );
    assert_eq!(backup.stats.requests(), 0);

    env.cli_ok(&file.path, &["providers", "qualify", "openai-backup"]);
    assert_eq!(
        qualification(&env, &file.path, "openai-backup"),
        ("qualified".into(), true)
    );
    let asked = backup.stats.requests();
    let job_id = submit(&producer, "acct_route", "k-2", "after").await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    let providers: Vec<(&str, AttemptStatus)> = job
        .attempts
        .iter()
        .map(|a| (a.provider.as_str(), a.status))
        .collect();
    assert_eq!(
        providers,
        [
            ("anthropic-main", AttemptStatus::Failed),
            ("openai-backup", AttemptStatus::Succeeded)
        ]
    );
    assert!(
        job.result.unwrap()["summary"]
            .as_str()
            .unwrap()
            .contains("from backup")
    );
    assert_eq!(backup.stats.requests(), asked + 1);

    producer.close().await;
    fleet.stop().await;
}

/// An Anthropic provider qualifies through its own wire format; its
/// qualification names its kind, so the same provider switched to another
/// kind is stale until qualified again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_qualification_goes_stale_when_its_providers_kind_changes() {
    let provider = mock(MockOptions::default()).await;
    let url = provider.base_url();
    let text = |kind: &str| {
        config_for(
            &[
                P("primary", &url, ""),
                P("backup", &url, &format!("kind = \"{kind}\"")),
            ],
            "",
        )
    };
    let (cfg, file) = config(&text("anthropic"));
    let env = TestEnv::new(&cfg).await;
    env.cli_ok(&file.path, &["providers", "qualify", "backup"]);
    assert_eq!(
        qualification(&env, &file.path, "backup"),
        ("qualified".into(), true)
    );
    assert!(provider.stats.uncapped() == 0 && provider.stats.requests() > 0);
    let openai = common::tempfile_path::TempConfig::new(&text("openai"));
    assert_eq!(
        qualification(&env, &openai.path, "backup"),
        ("stale".into(), false),
        "a qualification through one wire format is not another's"
    );
}
