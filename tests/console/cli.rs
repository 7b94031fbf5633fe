//! The operator CLI beside the console: operator tokens, and resolve and
//! cancel audited with their reasons.

use crate::common::console::{two_providers, unknown_job};
use crate::common::{TestEnv, config};
use onejob::settings::token::Token;

#[tokio::test]
async fn the_cli_makes_operator_tokens_and_audits_its_resolve_and_cancel() {
    let (config, file) = config(&two_providers());
    let env = TestEnv::new(&config).await;

    // An operator token: printed once, ojo_, listed apart, revocable.
    let out = env.cli_ok(&file.path, &["tokens", "create", "--operator", "ada"]);
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(Token::parse_operator(&token).is_some(), "{token}");
    let out = env.cli_ok(&file.path, &["--json", "tokens", "list", "--operators"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["operator"], "ada");
    let out = env.cli_ok(&file.path, &["--json", "tokens", "list"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "[]",
        "tenant tokens are apart"
    );
    let id = listed[0]["id"].as_str().unwrap().to_owned();
    let out = env.cli_ok(&file.path, &["tokens", "revoke", &id]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("of operator ada revoked"));
    // Either kind must be said.
    let out = env.cli(&file.path, &["tokens", "create"]);
    assert_eq!(out.status.code(), Some(2));

    // Resolve and cancel with a reason: each leaves an audit row that `jobs
    // show` prints.
    let (job_id, s) = unknown_job(&env.store, "cli-1").await;
    let attempt = s.attempt_id.to_string();
    env.cli_ok(
        &file.path,
        &[
            "attempts",
            "resolve",
            &attempt,
            "--as",
            "failed",
            "--reason",
            "ticket OPS-42",
        ],
    );
    let job = job_id.to_string();
    env.cli_ok(
        &file.path,
        &["jobs", "cancel", &job, "--reason", "customer withdrew"],
    );
    let out = env.cli_ok(&file.path, &["--json", "jobs", "show", &job]);
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let audit = shown["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 2, "{shown}");
    assert_eq!(audit[0]["action"], "attempt.resolve_failed");
    assert_eq!(audit[0]["reason"], "ticket OPS-42");
    assert_eq!(audit[0]["attempt_id"], attempt.as_str());
    assert_eq!(audit[1]["action"], "job.cancel");
    assert_eq!(audit[1]["reason"], "customer withdrew");
    assert!(audit[1]["actor"].as_str().unwrap().starts_with("cli:"));
    let out = env.cli_ok(&file.path, &["jobs", "show", &job]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("job.cancel") && text.contains("\"customer withdrew\""),
        "{text}"
    );
    // A refused action writes nothing.
    let out = env.cli(&file.path, &["jobs", "cancel", &job, "--reason", "again"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(env.store.audit().of_job(job_id).await.unwrap().len(), 2);
}
