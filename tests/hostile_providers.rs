//! A provider is not trusted with where tenant data goes: its redirects are
//! never followed.

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
