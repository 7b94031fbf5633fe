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
