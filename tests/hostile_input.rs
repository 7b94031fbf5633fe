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
