//! Providers are not trusted with where tenant data goes, and the mock
//! provider takes no orders from tenants' prompts unless told to.

use onejob::domain::JobStatus;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

use crate::common::{TestEnv, config, config_text, mock, submit, wait_for_status};

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

/// Posts a chat completion whose prompt is `prompt` to the mock at `base`,
/// with `key` as its Idempotency-Key.
async fn ask_mock(
    base: &str,
    prompt: &str,
    key: &str,
) -> Result<reqwest::Response, reqwest::Error> {
    reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .header("idempotency-key", key)
        .json(&serde_json::json!({"messages": [{"role": "user", "content": prompt}]}))
        .send()
        .await
}

/// The mock provider's `mock:` directives come from the prompt, which is a
/// tenant's text: it honours them only when started with them allowed, clamps
/// them when it does, and keeps a bounded record of what it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mock_takes_no_orders_from_tenants_by_default() {
    let addr = "127.0.0.1:0".parse().unwrap();
    let plain = onejob::mock::start(addr, MockOptions::default())
        .await
        .unwrap();
    let answer = ask_mock(&plain.base_url(), "hello mock:status=503 mock:prose", "k")
        .await
        .unwrap();
    assert_eq!(
        answer.status(),
        reqwest::StatusCode::OK,
        "a directive was obeyed"
    );
    let text = answer.text().await.unwrap();
    assert!(text.contains("mock answer"), "{text}");

    let steered = onejob::mock::start(
        addr,
        MockOptions {
            directives: true,
            record_limit: 100,
            ..MockOptions::default()
        },
    )
    .await
    .unwrap();
    let answer = ask_mock(&steered.base_url(), "mock:status=503", "k")
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    // A pad no machine could hold is clamped, not attempted.
    let answer = ask_mock(&steered.base_url(), "mock:pad=1000000000000000000", "k")
        .await
        .expect("an answer, not a crash");
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    let size = answer.bytes().await.unwrap().len();
    assert!(size <= onejob::mock::MAX_PAD + 4096, "{size} bytes");
    let answer = ask_mock(&steered.base_url(), "mock:status=99999", "k")
        .await
        .unwrap();
    assert_eq!(
        answer.status(),
        reqwest::StatusCode::OK,
        "no such status: ignored"
    );

    for i in 0..150 {
        ask_mock(&steered.base_url(), "hi", &format!("key-{i}"))
            .await
            .unwrap();
    }
    let keys = steered.stats.idempotency_keys();
    assert_eq!(keys.len(), 100, "the record is bounded");
    assert_eq!(
        keys.last().map(String::as_str),
        Some("key-149"),
        "the latest kept"
    );
}
