//! Operator actions from the CLI are audited, and audited first: one whose
//! audit row cannot be written is not done.

use std::path::Path;

use onejob::mock::{MockHandle, MockOptions};

use crate::common::{self, TestEnv, config, mock};

/// The audit rows of `action`, oldest first, as (target, reason, detail).
async fn audit_rows(env: &TestEnv, action: &str) -> Vec<(String, String, serde_json::Value)> {
    sqlx::query_as::<_, (Option<String>, String, serde_json::Value)>(
        "SELECT target, reason, detail FROM audit WHERE action = $1 ORDER BY at, id",
    )
    .bind(action)
    .fetch_all(env.store.pool())
    .await
    .unwrap()
    .into_iter()
    .map(|(t, r, d)| (t.unwrap_or_default(), r, d))
    .collect()
}

/// Granting access, taking it away, spending money and setting an owner's
/// limits from the CLI are operator actions like any other: each is audited, and audited first, so
/// one whose row cannot be written is not done.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_operator_action_from_the_cli_is_audited_first() {
    let provider = mock(MockOptions::default()).await;
    let url = provider.base_url();
    let (config, file) = config(&common::config_for(
        &[
            common::P("primary", &url, ""),
            common::P("fallback", &url, ""),
        ],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let path = &file.path;

    tokens_created_and_revoked_are_audited(&env, path).await;
    a_qualification_is_audited(&env, path).await;
    // From now on the audit table refuses every row: nothing is done.
    common::database::refuse_audit(&env).await;
    nothing_unaudited_is_done(&env, path, &provider).await;
}

/// The id of the first operator token listed.
fn listed_operator(env: &TestEnv, path: &Path) -> String {
    let out = env.cli_ok(path, &["--json", "tokens", "list", "--operators"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    listed[0]["id"].as_str().unwrap().to_owned()
}

/// A tenant's token and an operator's created, and the tenant's revoked: each
/// audited with its target, its reason and the token's id.
async fn tokens_created_and_revoked_are_audited(env: &TestEnv, path: &Path) {
    env.cli_ok(
        path,
        &[
            "tokens",
            "create",
            "--owner",
            "acct_a",
            "--reason",
            "onboarding",
        ],
    );
    env.cli_ok(path, &["tokens", "create", "--operator", "ada"]);
    let out = env.cli_ok(path, &["--json", "tokens", "list"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tenant_token = listed[0]["id"].as_str().unwrap().to_owned();
    let created = audit_rows(env, "token.create").await;
    assert_eq!(created.len(), 2, "{created:?}");
    assert_eq!(created[0].0, "owner:acct_a");
    assert_eq!(created[0].1, "onboarding");
    assert_eq!(created[0].2["token_id"], tenant_token.as_str());
    assert_eq!(created[1].0, "operator:ada");

    env.cli_ok(
        path,
        &[
            "tokens",
            "revoke",
            &tenant_token,
            "--reason",
            "contract ended",
        ],
    );
    let revoked = audit_rows(env, "token.revoke").await;
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert_eq!(revoked[0].0, "owner:acct_a");
    assert_eq!(revoked[0].1, "contract ended");
    assert_eq!(revoked[0].2["token_id"], tenant_token.as_str());
}

/// A qualification, which spends money, is audited with its reason and what
/// it found.
async fn a_qualification_is_audited(env: &TestEnv, path: &Path) {
    let out = env.cli(
        path,
        &["providers", "qualify", "primary", "--reason", "new key"],
    );
    assert!(out.status.code().is_some(), "{out:?}");
    let qualified = audit_rows(env, "provider.qualify").await;
    assert_eq!(qualified.len(), 1, "{qualified:?}");
    assert_eq!(qualified[0].1, "new key");
    assert!(
        qualified[0].0.starts_with("primary/"),
        "{:?}",
        qualified[0].0
    );
    assert!(
        matches!(qualified[0].2["outcome"].as_str(), Some("done")),
        "{:?}",
        qualified[0].2
    );
    assert!(qualified[0].2["cases"].as_u64().unwrap() > 0);
}

/// With the audit table refusing every row, no token is made or revoked and
/// no paid call is made.
async fn nothing_unaudited_is_done(env: &TestEnv, path: &Path, provider: &MockHandle) {
    let tokens = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT (SELECT count(*) FROM gateway_tokens) + (SELECT count(*) FROM operator_tokens)",
        )
        .fetch_one(env.store.pool())
        .await
        .unwrap()
    };
    let before = tokens().await;
    let out = env.cli(path, &["tokens", "create", "--owner", "acct_b"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "no token is shown");
    assert_eq!(tokens().await, before, "no token was made");
    let operator_token = listed_operator(env, path);
    let out = env.cli(path, &["tokens", "revoke", &operator_token]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let still: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT revoked_at FROM operator_tokens WHERE id = $1::uuid")
            .bind(&operator_token)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert!(still.is_none(), "the token was not revoked");
    let calls = provider.stats.requests();
    let out = env.cli(path, &["providers", "qualify", "primary"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(provider.stats.requests(), calls, "no paid call was made");
    let out = env.cli(
        path,
        &[
            "owners",
            "set",
            "acct_b",
            "--daily-tokens",
            "5",
            "--reason",
            "r",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let owners: i64 = sqlx::query_scalar("SELECT count(*) FROM owners")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert_eq!(owners, 0, "no owner's limits were set");
}
