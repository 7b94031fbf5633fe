//! The gateway's own life: it describes itself and its readiness, answers a
//! request in flight at shutdown, stops when it loses RabbitMQ, and forgets
//! the submits its callers abandon.

use std::sync::Arc;
use std::time::Duration;

use onejob::mock::MockOptions;
use onejob_producer::gateway::{GatewayOptions, OPENAPI};
use reqwest::StatusCode;
use serde_json::Value;

use super::{SUMMARIZE, Served, with_components};
use crate::common::{self, TestEnv, config, config_text, mock, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_describes_itself_and_reports_readiness() {
    let s = Served::start().await;
    let served = s.fetch("/openapi.json").await;
    assert_eq!(served.status(), StatusCode::OK);
    assert_eq!(
        served
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    let doc: Value = served.json().await.unwrap();
    assert_eq!(doc, serde_json::from_str::<Value>(OPENAPI).unwrap());
    assert_eq!(doc["openapi"], "3.1.0");
    for path in ["/v1/jobs", "/v1/jobs/{id}", "/healthz", "/readyz"] {
        assert!(doc["paths"][path].is_object(), "{path} is documented");
    }
    // Every schema the document names compiles.
    for (name, schema) in doc["components"]["schemas"].as_object().unwrap() {
        assert!(
            jsonschema::validator_for(&with_components(&doc, schema)).is_ok(),
            "{name}"
        );
    }
    let ready = s.fetch("/readyz").await;
    assert_eq!(ready.status(), StatusCode::OK);
    assert_eq!(ready.text().await.unwrap(), "postgres: ok\nrabbitmq: ok\n");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_in_flight_at_shutdown_gets_its_answer() {
    // No fleet yet: the intent waits in its queue, and the request for its receipt.
    let mut s = Served::start_with(false, GatewayOptions::default()).await;
    let token = s.token("acct_1");
    let request = {
        let http = s.http.clone();
        let url = format!("{}/v1/jobs", s.base);
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(token)
                .header("Idempotency-Key", "k-late")
                .body(SUMMARIZE)
                .send()
                .await
        })
    };
    let amqp = s.env.amqp().await;
    let channel = amqp.create_channel().await.unwrap();
    common::wait_for_depth(
        "the intent to be published",
        Duration::from_secs(10),
        &channel,
        onejob::broker::INTENTS_QUEUE,
        1,
    )
    .await;
    // SIGTERM now: the gateway stops taking connections but answers this one,
    // once intake (started only now) has admitted the job.
    s.shutdown.trigger();
    s.fleet = Some(
        s.env
            .fleet(s.config.clone(), vec![onejob::fleet::Role::Intake])
            .await,
    );
    let response = request
        .await
        .unwrap()
        .expect("an answer, not a dropped connection");
    assert_eq!(response.status(), StatusCode::CREATED);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_stops_with_an_error_when_it_loses_rabbitmq() {
    let s = Served::start_with(false, GatewayOptions::default()).await;
    assert_eq!(s.fetch("/readyz").await.status(), StatusCode::OK);
    // The broker closes every connection of this test's vhost.
    let out = std::process::Command::new("rabbitmqctl")
        .args([
            "close_all_connections",
            "-p",
            &s.env.name,
            "test: connection lost",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let served = tokio::time::timeout(Duration::from_secs(20), s.server)
        .await
        .expect("the gateway stops by itself")
        .unwrap();
    assert!(
        matches!(
            served,
            Err(onejob_producer::gateway::GatewayError::ConnectionLost)
        ),
        "{served:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abandoned_submit_leaves_no_waiter_behind() {
    // No intake: no receipt ever comes. The caller gives up, as an HTTP server
    // does when its client disconnects, and the producer forgets the waiter.
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let producer = Arc::new(
        onejob_producer::Producer::connect(&env.amqp_url)
            .await
            .unwrap(),
    );
    let abandoned: Vec<_> = (0..10)
        .map(|i| {
            let producer = producer.clone();
            tokio::spawn(async move {
                let _ = producer
                    .submit(&common::intent("acct_1", &format!("gone-{i}"), "x"))
                    .await;
            })
        })
        .collect();
    wait_for("ten submits waiting", Duration::from_secs(10), || async {
        (producer.waiting() == 10).then_some(())
    })
    .await;
    for task in abandoned {
        task.abort();
        let _ = task.await;
    }
    assert_eq!(producer.waiting(), 0);
}
