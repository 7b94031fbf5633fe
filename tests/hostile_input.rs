//! Hostile input from outside: a provider is not trusted with where tenant
//! data goes (its redirects are never followed), and secrets pasted into URLs
//! are never printed.

mod common;

use common::{TestEnv, config, config_text, mock, submit, wait_for_status};
use onejob::domain::JobStatus;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

/// A provider endpoint that answers every call with a redirect to `target`
/// (307 keeps the method and the body: a client that follows it re-POSTs the
/// prompt there).
async fn redirecting_to(target: String) -> String {
    let app = axum::Router::new().fallback(move || {
        let target = target.clone();
        async move {
            (
                axum::http::StatusCode::TEMPORARY_REDIRECT,
                [(axum::http::header::LOCATION, target)],
            )
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/v1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_providers_redirect_is_never_followed() {
    // Where a redirect would take the prompt: a server that records what it got.
    let elsewhere = mock(MockOptions::default()).await;
    let provider = redirecting_to(format!("{}/chat/completions", elsewhere.base_url())).await;
    let (config, _file) = config(&config_text(&provider, None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job = submit(&producer, "acct_redirect", "k-1", "tenant secret").await;
    let job = wait_for_status(&env, job, JobStatus::Failed).await;
    assert_eq!(
        elsewhere.stats.requests(),
        0,
        "the prompt never went where the redirect pointed"
    );
    for attempt in &job.attempts {
        let error = attempt.error.as_deref().unwrap_or_default();
        assert!(
            error.contains("307"),
            "a redirect is a definite failure: {error}"
        );
    }
    fleet.stop().await;
}

/// A secret in a provider's URL (a key in its query string) or in a
/// connection URL's password pasted with an unencoded `#`, `/` or `?` is never
/// printed, `--json` included.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn secrets_in_urls_are_never_printed() {
    let (config, file) = config(&config_text(
        "http://127.0.0.1:9/v1?api-key=Winter",
        None,
        "",
    ));
    let env = TestEnv::new(&config).await;
    for args in [
        &["providers", "list", "--json"][..],
        &["providers", "list"][..],
    ] {
        let out = env.cli(&file.path, args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("api-key=***") && !text.contains("Winter"),
            "{text}"
        );
    }
    for url in [
        "postgres://svc:2024#Winter@127.0.0.1:1/onejob",
        "postgres://svc:12/Winter@127.0.0.1:1/onejob",
        "postgres://svc:2024?Winter@127.0.0.1:1/onejob",
    ] {
        for json in [false, true] {
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_onejob"));
            cmd.args(["jobs", "find", "--owner", "o", "--key", "k"])
                .env("DATABASE_URL", url)
                .env("AMQP_URL", &env.amqp_url)
                .env("ONEJOB_CONFIG", &file.path);
            if json {
                cmd.arg("--json");
            }
            let out = cmd.output().unwrap();
            let all = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!out.status.success());
            assert!(!all.contains("Winter"), "{url}: {all}");
        }
    }
}

/// Every answer of the console, signed in or not, page or error or redirect
/// or stylesheet, forbids framing and caching and allows no inline script or
/// style: what a page shows cannot be framed by another site, left in a
/// shared cache, or turned into script by text that slipped through.
#[tokio::test]
async fn every_console_answer_forbids_framing_caching_and_inline_code() {
    use common::console::{serve, two_providers, unknown_job};
    use reqwest::header::COOKIE;

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let (job, started) = unknown_job(&env.store, "k-frames").await;
    let attempt = started.attempt_id;

    let signed_in = [
        "/".to_owned(),
        "/jobs".to_owned(),
        format!("/jobs/{job}"),
        "/unknowns".to_owned(),
        format!("/attempts/{attempt}/resolve?as=failed"),
        "/dead-letters".to_owned(),
        "/dead-letters/confirm?action=replay&queue=onejob.intents.dlq".to_owned(),
        "/providers".to_owned(),
        "/providers/qualify?provider=primary".to_owned(),
        "/no-such-page".to_owned(),
        "/static/console.css".to_owned(),
    ];
    let mut answers = Vec::new();
    for path in &signed_in {
        let answer = served
            .http
            .get(format!("{}{path}", served.base))
            .header(COOKIE, &session.cookie)
            .send()
            .await
            .unwrap();
        answers.push((format!("GET {path} (signed in)"), answer));
    }
    for path in ["/login", "/", "/jobs"] {
        let answer = served
            .http
            .get(format!("{}{path}", served.base))
            .send()
            .await
            .unwrap();
        answers.push((format!("GET {path} (signed out)"), answer));
    }
    let refused = served
        .post(&session.cookie, "/logout", &[("csrf", "forged")])
        .await;
    answers.push(("POST /logout (forged)".to_owned(), refused));

    for (what, answer) in answers {
        let h = answer.headers().clone();
        let get = |name: &str| {
            h.get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(get("x-frame-options"), "DENY", "{what}");
        let csp = get("content-security-policy");
        for directive in [
            "default-src 'none'",
            "frame-ancestors 'none'",
            "form-action 'self'",
            "base-uri 'none'",
            "style-src 'self'",
        ] {
            assert!(csp.contains(directive), "{what}: {directive} in {csp:?}");
        }
        assert!(!csp.contains("unsafe-inline"), "{what}: {csp}");
        assert!(get("cache-control").contains("no-store"), "{what}");
        assert_eq!(get("x-content-type-options"), "nosniff", "{what}");
        assert_eq!(get("referrer-policy"), "no-referrer", "{what}");
        let body = answer.text().await.unwrap().to_ascii_lowercase();
        assert!(!body.contains("<script"), "{what}: inline script");
        assert!(!body.contains(" style="), "{what}: inline style");
        assert!(!body.contains("<style"), "{what}: inline style");
    }
}

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

/// Granting access, taking it away and spending money from the CLI are
/// operator actions like any other: each is audited, and audited first, so
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
    let created = audit_rows(&env, "token.create").await;
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
    let revoked = audit_rows(&env, "token.revoke").await;
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert_eq!(revoked[0].0, "owner:acct_a");
    assert_eq!(revoked[0].1, "contract ended");
    assert_eq!(revoked[0].2["token_id"], tenant_token.as_str());

    let out = env.cli(
        path,
        &["providers", "qualify", "primary", "--reason", "new key"],
    );
    assert!(out.status.code().is_some(), "{out:?}");
    let qualified = audit_rows(&env, "provider.qualify").await;
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

    // From now on the audit table refuses every row: nothing is done.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'the audit table refuses rows'; END $$;
         CREATE TRIGGER refuse BEFORE INSERT ON audit FOR EACH ROW EXECUTE FUNCTION refuse();",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
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
    let operator_token = listed_operator(&env, path);
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
}

fn listed_operator(env: &TestEnv, path: &std::path::Path) -> String {
    let out = env.cli_ok(path, &["--json", "tokens", "list", "--operators"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    listed[0]["id"].as_str().unwrap().to_owned()
}
