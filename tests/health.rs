//! The worker's `/healthz`, `/readyz` and `/metrics`: readiness follows each
//! service's connection, and the per-process counters follow what the worker did,
//! beside the gauges read from the tables. A binary of its own, so that the
//! process-wide counters see this test's work alone whichever runner runs it.

use onejob_test_support as common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestEnv, config, config_text, mock, submit, wait_for_status};
use onejob::domain::{JobId, JobStatus};
use onejob::edges::shutdown::Shutdown;
use onejob::intent::Outcome;
use onejob::mock::MockOptions;
use onejob::settings::config::Config;
use onejob_producer::Producer;
use reqwest::StatusCode;
use sqlx::Connection;

/// Polls `/metrics` until every expected sample has its value, or 20 s have
/// passed; returns the last text either way, for the caller's assertions to show.
async fn settled<F, Fut>(get: &F, expected: &[(&str, f64)]) -> String
where
    F: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = (StatusCode, String)>,
{
    let start = std::time::Instant::now();
    loop {
        let (status, text) = get("/metrics").await;
        assert_eq!(status, StatusCode::OK);
        let done = expected
            .iter()
            .all(|(series, value)| sample(&text, series) == Some(*value));
        if done || start.elapsed() > Duration::from_secs(20) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The value of the sample whose line starts with `series` (name and labels).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readiness_follows_connectivity_and_metrics_follow_the_work() {
    let primary = mock(MockOptions::default()).await;
    let (config, _file) = config(&config_text(&primary.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let ctx = fleet.ctx.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(
        axum::serve(
            listener,
            onejob::shared::runtime::health_router(ctx.clone()),
        )
        .into_future(),
    );
    let http = reqwest::Client::new();
    let get = |path: &'static str| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let r = http.get(format!("{base}{path}")).send().await.unwrap();
            (r.status(), r.text().await.unwrap())
        }
    };

    assert_eq!(get("/healthz").await, (StatusCode::OK, "ok\n".into()));
    assert_eq!(
        get("/readyz").await,
        (StatusCode::OK, "postgres: ok\nrabbitmq: ok\n".into())
    );

    let job_id = the_work_is_counted(&env, &get).await;
    the_gateway_counts_its_answers(&config, &env, &http, job_id).await;

    // RabbitMQ lost: not ready. Postgres lost too: both say so.
    fleet.stop().await;
    let (status, text) = get("/readyz").await;
    assert_eq!(
        (status, text.as_str()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "postgres: ok\nrabbitmq: down\n"
        )
    );
    ctx.store.close().await;
    let (status, text) = get("/readyz").await;
    assert_eq!(
        (status, text.as_str()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "postgres: down\nrabbitmq: down\n"
        )
    );
    assert_eq!(
        get("/healthz").await.0,
        StatusCode::OK,
        "alive all the same"
    );
    server.abort();
}

/// What the work of the readiness test leaves in `/metrics`: one job created,
/// one duplicate, one rejected intent.
const WORK_SAMPLES: &[(&str, f64)] = &[
    (
        r#"onejob_attempts_settled_total{provider="primary",settled="won"}"#,
        1.0,
    ),
    // The first attempt's message and the job.succeeded event.
    ("onejob_outbox_published_total", 2.0),
    (r#"onejob_intents_total{outcome="created"}"#, 1.0),
    (r#"onejob_intents_total{outcome="duplicate"}"#, 1.0),
    (r#"onejob_intents_total{outcome="rejected"}"#, 1.0),
    (r#"onejob_dead_letters_total{queue="onejob.intents"}"#, 1.0),
    (
        r#"onejob_provider_call_seconds_count{provider="primary",result="answered"}"#,
        1.0,
    ),
    (
        r#"onejob_provider_call_seconds_bucket{provider="primary",result="answered",le="+Inf"}"#,
        1.0,
    ),
    // Each stage of the way is timed: two intents admitted, one attempt
    // through every stage of its path.
    (r#"onejob_stage_seconds_count{stage="intake_admit"}"#, 2.0),
    (r#"onejob_stage_seconds_count{stage="intake_publish"}"#, 1.0),
    (r#"onejob_stage_seconds_count{stage="intake_answer"}"#, 3.0),
    // The job is called as soon as it is admitted (a call slot is free): its
    // message's delivery is dropped before it would wait for a slot.
    (
        r#"onejob_attempts_claimed_on_admission_total{provider="primary"}"#,
        1.0,
    ),
    (r#"onejob_stage_seconds_count{stage="claim_wait"}"#, 1.0),
    (r#"onejob_stage_seconds_count{stage="claim"}"#, 1.0),
    (r#"onejob_stage_seconds_count{stage="attempt_call"}"#, 1.0),
    (r#"onejob_stage_seconds_count{stage="settle_wait"}"#, 1.0),
    (r#"onejob_stage_seconds_count{stage="settle"}"#, 1.0),
    (r#"onejob_stage_seconds_count{stage="attempt_ack"}"#, 1.0),
    (r#"onejob_stage_seconds_count{stage="settle_publish"}"#, 1.0),
    (
        r#"onejob_stage_seconds_bucket{stage="settle",le="+Inf"}"#,
        1.0,
    ),
    // The gauges read from the tables are there too.
    (r#"onejob_jobs{status="succeeded"}"#, 1.0),
    (r#"onejob_attempts{status="succeeded"}"#, 1.0),
    ("onejob_outbox_unpublished", 0.0),
    // One server: no standby, so no commit waits for one.
    ("onejob_database_commits_wait_for_standby", 0.0),
    ("onejob_database_standbys", 0.0),
];

/// One job created, one duplicate, one rejected intent: `/metrics` counts
/// each, and what the job went through. Returns the job.
async fn the_work_is_counted<F, Fut>(env: &TestEnv, get: &F) -> JobId
where
    F: Fn(&'static str) -> Fut,
    Fut: std::future::Future<Output = (StatusCode, String)>,
{
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_m", "k-1", "counted").await;
    assert_eq!(submit(&producer, "acct_m", "k-1", "counted").await, job_id);
    let rejected = producer.submit_raw(b"not json").await.unwrap();
    assert_eq!(rejected.outcome, Outcome::Rejected);
    wait_for_status(env, job_id, JobStatus::Succeeded).await;

    let text = settled(get, WORK_SAMPLES).await;
    for (series, value) in WORK_SAMPLES {
        assert_eq!(sample(&text, series), Some(*value), "{series} in\n{text}");
    }
    assert_eq!(
        sample(&text, r#"onejob_intents_total{outcome="conflict"}"#),
        None
    );
    producer.close().await;

    job_id
}

/// The gateway counts its answers by route and status, on its probes listener
/// only.
async fn the_gateway_counts_its_answers(
    config: &Arc<Config>,
    env: &TestEnv,
    http: &reqwest::Client,
    job_id: JobId,
) {
    let (public_url, probes_url, stop, serving) = gateway_with_probes(config, env).await;
    let token = onejob::settings::token::Token::generate();
    env.store
        .tokens()
        .create_token("acct_m", &token, &onejob::edges::store::Actor::cli(None))
        .await
        .unwrap();
    for key in ["g-1", "g-1", "g-2"] {
        let r = http
            .post(format!("{public_url}/v1/jobs"))
            .bearer_auth(token.reveal())
            .header("Idempotency-Key", key)
            .body(r#"{"operation":"summarize","input":{"text":"via http"}}"#)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }
    let unauthorized = http
        .get(format!("{public_url}/v1/jobs/{job_id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized.status(), StatusCode::UNAUTHORIZED);
    let public_metrics = http
        .get(format!("{public_url}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        public_metrics.status(),
        StatusCode::NOT_FOUND,
        "no metrics for tenants"
    );
    probes_count_the_answers(http, &probes_url).await;
    stop.trigger();
    serving.await.unwrap().unwrap();
}

/// A gateway in front of `env`, serving its public listener and its probes
/// listener: their URLs, its shutdown and its task.
async fn gateway_with_probes(
    config: &Arc<Config>,
    env: &TestEnv,
) -> (
    String,
    String,
    Shutdown,
    tokio::task::JoinHandle<onejob_producer::gateway::Result<()>>,
) {
    let gateway = onejob_producer::gateway::Gateway::connect(
        config.clone(),
        &env.database_url,
        &env.amqp_url,
        onejob_producer::gateway::GatewayOptions::default(),
    )
    .await
    .unwrap();
    let public = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let probes = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (public_url, probes_url) = (
        format!("http://{}", public.local_addr().unwrap()),
        format!("http://{}", probes.local_addr().unwrap()),
    );
    let stop = Shutdown::new();
    let serving = tokio::spawn(Arc::new(gateway).serve(public, Some(probes), stop.clone()));
    (public_url, probes_url, stop, serving)
}

/// The probes listener's `/metrics` counts the gateway's answers by route and
/// status, and its `/readyz` says ready.
async fn probes_count_the_answers(http: &reqwest::Client, probes_url: &str) {
    let text = http
        .get(format!("{probes_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (series, value) in [
        (
            r#"onejob_gateway_requests_total{route="/v1/jobs",status="201"}"#,
            2.0,
        ),
        (
            r#"onejob_gateway_requests_total{route="/v1/jobs",status="200"}"#,
            1.0,
        ),
        (
            r#"onejob_gateway_requests_total{route="/v1/jobs/{id}",status="401"}"#,
            1.0,
        ),
    ] {
        assert_eq!(sample(&text, series), Some(value), "{series} in\n{text}");
    }
    let ready = http
        .get(format!("{probes_url}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
}

/// A scrape never reads the tables: the gauges come from a cache that a timer
/// refreshes, so scrapes (however many) cost the database nothing, and a
/// table held by a long lock does not hold up `/metrics`. The cache's age is
/// a gauge of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_are_served_from_a_cache_not_the_tables() {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let ctx = env.context(config.clone()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(
        axum::serve(
            listener,
            onejob::shared::runtime::health_router(ctx.clone()),
        )
        .into_future(),
    );
    let http = reqwest::Client::new();
    let scrape = || {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let r = http.get(format!("{base}/metrics")).send().await.unwrap();
            (r.status(), r.text().await.unwrap())
        }
    };
    common::wait_for("the first gauges", Duration::from_secs(20), || async {
        let (status, text) = scrape().await;
        (status == StatusCode::OK && text.contains("onejob_jobs{status=\"queued\"}")).then_some(())
    })
    .await;

    // Another session holds both tables under a lock no read can pass.
    let mut holder = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE jobs, attempts IN ACCESS EXCLUSIVE MODE")
        .execute(&mut holder)
        .await
        .unwrap();
    let scrapes = futures_util::future::join_all(
        (0..50).map(|_| tokio::time::timeout(Duration::from_secs(10), scrape())),
    )
    .await;
    for answer in scrapes {
        let (status, text) = answer.expect("a scrape waited on the tables");
        assert_eq!(status, StatusCode::OK);
        assert!(text.contains("onejob_jobs{status=\"queued\"} 0"), "{text}");
        assert!(
            sample(&text, "onejob_gauges_age_seconds").is_some(),
            "{text}"
        );
    }
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    server.abort();
}

/// The worker's probes listener bounds slow clients as the gateway does: a
/// connection that sends half a request line is closed after the header
/// timeout (10 s), not held for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_probes_listener_closes_slow_headers() {
    use common::raw_http::{stalled, until_closed};

    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let addr = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        free.local_addr().unwrap()
    };
    let mut worker = std::process::Command::new(common::chaos::worker_bin())
        .args(["--http", &addr.to_string()])
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", &file.path)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let http = reqwest::Client::new();
    common::wait_for("the probes", Duration::from_secs(30), || async {
        let r = http
            .get(format!("http://{addr}/healthz"))
            .send()
            .await
            .ok()?;
        (r.status() == StatusCode::OK).then_some(())
    })
    .await;
    let mut slow = stalled(&addr.to_string(), "GET /heal").await;
    let closed = tokio::time::timeout(Duration::from_secs(30), until_closed(&mut slow)).await;
    let _ = worker.kill();
    let _ = worker.wait();
    assert!(closed.is_ok(), "the slow connection was never closed");
}
