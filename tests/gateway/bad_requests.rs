//! Bad requests get specific errors, and publish nothing.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{SUMMARIZE, Served};
use crate::common::{self, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_specific_errors_and_publish_nothing() {
    let s = Served::start().await;
    let token = s.token("acct_1");
    let unknown_token = onejob::settings::token::Token::generate();
    let long_key = "k".repeat(256);

    let cases = cases(&token, unknown_token.reveal(), &long_key);
    for (token, key, body, status, code) in cases {
        let answer = s.post(token, key, &body).await;
        assert_eq!(answer.status, status, "{code}: {answer:?}");
        answer.conforms("/v1/jobs", "post");
        let error = answer.body["error"].as_str().unwrap_or_default();
        assert!(error.starts_with(code), "expected {code}, got {error:?}");
        if status == StatusCode::UNAUTHORIZED {
            assert!(
                answer
                    .header("www-authenticate")
                    .is_some_and(|v| v.starts_with("Bearer"))
            );
        }
    }
    nothing_reached_the_fleet(&s, &token).await;
    s.stop().await;
}

/// A bad request: its token, its Idempotency-Key and its body, and the status
/// and error code it must get.
type Case<'a> = (
    Option<&'a str>,
    Option<&'a str>,
    String,
    StatusCode,
    &'a str,
);

/// Every kind of bad request, sent with the owner's good `token`, a
/// well-formed `unknown_token` and a `long_key` of 256 characters: first the
/// refused credentials and the missing key, then the refused bodies, last a
/// key too long.
fn cases<'a>(token: &'a str, unknown_token: &'a str, long_key: &'a str) -> Vec<Case<'a>> {
    let mut cases = refused_headers(token, unknown_token);
    cases.extend(refused_bodies(token, long_key));
    cases.push((
        Some(token),
        Some(long_key),
        SUMMARIZE.into(),
        StatusCode::BAD_REQUEST,
        "bad_length",
    ));
    cases
}

/// No token, one that is not a token, one this database does not know; and
/// a good token without an Idempotency-Key.
fn refused_headers<'a>(token: &'a str, unknown_token: &'a str) -> Vec<Case<'a>> {
    vec![
        (
            None,
            Some("k"),
            SUMMARIZE.into(),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            Some("not-a-token"),
            Some("k"),
            SUMMARIZE.into(),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            Some(unknown_token),
            Some("k"),
            SUMMARIZE.into(),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            Some(token),
            None,
            SUMMARIZE.into(),
            StatusCode::BAD_REQUEST,
            "missing_idempotency_key",
        ),
    ]
}

/// Bodies refused whatever the token: not JSON, not an object, a duplicate
/// field, a number JSON cannot hold exactly, a field the owner may not set,
/// an unknown operation or provider, and bodies too large.
fn refused_bodies<'a>(token: &'a str, long_key: &'a str) -> Vec<Case<'a>> {
    vec![
        (
            Some(token),
            Some("k"),
            "not json".into(),
            StatusCode::BAD_REQUEST,
            "invalid_json",
        ),
        (
            Some(token),
            Some("k"),
            "[]".into(),
            StatusCode::BAD_REQUEST,
            "not_an_object",
        ),
        (
            Some(token),
            Some("k"),
            r#"{"operation":"summarize","input":{"text":"a","text":"b"}}"#.into(),
            StatusCode::BAD_REQUEST,
            "duplicate_field",
        ),
        (
            Some(token),
            Some("k"),
            r#"{"operation":"summarize","input":{"text":"a","n":9007199254740993}}"#.into(),
            StatusCode::BAD_REQUEST,
            "bad_number",
        ),
        (
            Some(token),
            Some("k"),
            r#"{"owner_id":"someone_else","operation":"summarize","input":{}}"#.into(),
            StatusCode::BAD_REQUEST,
            "unknown_field",
        ),
        (
            Some(token),
            Some("k"),
            r#"{"operation":"nope","input":{}}"#.into(),
            StatusCode::BAD_REQUEST,
            "unknown_operation",
        ),
        (
            Some(token),
            Some("k"),
            r#"{"operation":"summarize","input":{},"provider":"elsewhere"}"#.into(),
            StatusCode::BAD_REQUEST,
            "provider_not_in_route",
        ),
        (
            Some(token),
            Some("k"),
            format!(
                r#"{{"operation":"summarize","input":{{"text":"{}"}}}}"#,
                "x".repeat(onejob::intent::DEFAULT_MAX_BODY_BYTES)
            ),
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
        ),
        // A body just under the limit, whose message (with the owner and key
        // added) would be over it: refused here, not dead-lettered by intake.
        (
            Some(token),
            Some(&long_key[..200]),
            {
                let head = r#"{"operation":"summarize","input":{"text":""#;
                let tail = r#""}}"#;
                let fill = onejob::intent::DEFAULT_MAX_BODY_BYTES - 8 - head.len() - tail.len();
                format!("{head}{}{tail}", "x".repeat(fill))
            },
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
        ),
    ]
}

/// Nothing reached the fleet: no job, no dead letter. A good request after
/// them is answered once intake made its job; then intake is left to settle
/// every message published before it (the intents queue holds none, ready or
/// unacked: each was admitted or dead-lettered, and acked), and only then is
/// the fleet's work counted.
async fn nothing_reached_the_fleet(s: &Served, token: &str) {
    let marker = s
        .post(Some(token), Some("after-the-bad-ones"), SUMMARIZE)
        .await;
    assert_eq!(marker.status, StatusCode::CREATED, "{marker:?}");
    wait_for(
        "intake to settle every intent published",
        Duration::from_secs(20),
        || async {
            (common::queue_counts(&s.env.name, onejob::broker::INTENTS_QUEUE) == Some((0, 0)))
                .then_some(())
        },
    )
    .await;
    let jobs: Vec<(uuid::Uuid,)> = sqlx::query_as("SELECT id FROM jobs")
        .fetch_all(s.env.store.pool())
        .await
        .unwrap();
    assert_eq!(
        jobs,
        vec![(marker.job_id().0,)],
        "only the good request's job"
    );
    let out = s.env.cli_ok(
        &s.file.path,
        &["dlq", "list", "onejob.intents.dlq", "--json"],
    );
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed, json!([]), "no dead letter");
}
