//! Tokens: shown once, kept only as digests, revoked one at a time, and the
//! bearer scheme read case-insensitively.

use onejob::settings::token::Token;
use reqwest::StatusCode;
use serde_json::Value;

use super::{SUMMARIZE, Served};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_are_shown_once_and_only_their_digest_is_kept() {
    let s = Served::start().await;
    let out = s.env.cli_ok(
        &s.file.path,
        &["tokens", "create", "--owner", "acct_1", "--json"],
    );
    let created: Value = serde_json::from_slice(&out.stdout).unwrap();
    let keys: Vec<&str> = created
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys, ["owner_id", "token"], "the contract's shape exactly");
    assert_eq!(created["owner_id"], "acct_1");
    let token = created["token"].as_str().unwrap().to_owned();
    assert!(Token::parse(&token).is_some(), "{token}");

    // The database holds no trace of the token itself.
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT owner_id, token_sha256 FROM gateway_tokens")
            .fetch_all(s.env.store.pool())
            .await
            .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, "acct_1");
    assert_ne!(rows[0].1, token);
    assert!(!rows[0].1.contains(&token[4..]));

    // Text mode prints the token alone on stdout; listing never shows it.
    let second = s.token("acct_1");
    assert!(Token::parse(&second).is_some(), "{second}");
    let out = s.env.cli_ok(&s.file.path, &["tokens", "list", "--json"]);
    let listed = String::from_utf8(out.stdout).unwrap();
    assert!(!listed.contains(&token[4..]) && !listed.contains(&second[4..]));
    let listed: Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2);

    // Both work; revoking one stops it at its next request, not the other.
    assert_eq!(
        s.post(Some(&token), Some("k-1"), SUMMARIZE).await.status,
        StatusCode::CREATED
    );
    let id = listed[0]["id"].as_str().unwrap();
    let out = s.env.cli_ok(&s.file.path, &["tokens", "revoke", id]);
    assert!(String::from_utf8_lossy(&out.stdout).ends_with("revoked\n"));
    let again = s.env.cli_ok(&s.file.path, &["tokens", "revoke", id]);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("was already revoked on"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
    let refused = s.post(Some(&token), Some("k-1"), SUMMARIZE).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        s.post(Some(&second), Some("k-1"), SUMMARIZE).await.status,
        StatusCode::OK
    );
    let out = s.env.cli_ok(
        &s.file.path,
        &["tokens", "list", "--owner", "acct_1", "--json"],
    );
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(listed[0]["revoked_at"].is_string() && listed[1]["revoked_at"].is_null());

    // Refusals: a bad owner, an unknown token id.
    let out = s
        .env
        .cli(&s.file.path, &["tokens", "create", "--owner", "not ok"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad_characters"));
    let out = s.env.cli(
        &s.file.path,
        &["tokens", "revoke", &uuid::Uuid::now_v7().to_string()],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_bearer_scheme_is_case_insensitive() {
    let s = Served::start().await;
    let token = s.token("acct_1");
    for (i, scheme) in ["bearer", "BEARER", "Bearer"].iter().enumerate() {
        let response = s
            .http
            .post(format!("{}/v1/jobs", s.base))
            .header("authorization", format!("{scheme} {token}"))
            .header("idempotency-key", format!("k-{i}"))
            .body(SUMMARIZE)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "{scheme}");
    }
    let basic = s
        .http
        .post(format!("{}/v1/jobs", s.base))
        .header("authorization", format!("Basic {token}"))
        .header("idempotency-key", "k-basic")
        .body(SUMMARIZE)
        .send()
        .await
        .unwrap();
    assert_eq!(basic.status(), StatusCode::UNAUTHORIZED);
    s.stop().await;
}
