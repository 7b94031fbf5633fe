//! Spans exported over OTLP when it is configured: the gateway and the worker,
//! each a program of its own with the standard `OTEL_…` variables, send their
//! spans to a collector the test runs, and the spans make one trace from the
//! HTTP caller's span to the provider call.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use serde_json::Value;

use super::common::binaries::{Program, binary, listening};
use super::common::throwaway::free_port;
use super::common::{TestEnv, config, config_text, mock, wait_for, wait_for_status};
use super::{UPSTREAM, call_seen, context_of, upstream};
use onejob::domain::{JobId, JobStatus};
use onejob::mock::MockOptions;

/// One exported span, as OTLP/JSON names it.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
}

type Collected = Arc<Mutex<Vec<Span>>>;

/// An OTLP/HTTP collector for JSON: every span it is sent, with its service.
async fn collector() -> (String, Collected) {
    let spans: Collected = Arc::default();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(receive))
        .with_state(spans.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}

async fn receive(State(spans): State<Collected>, Json(body): Json<Value>) -> Json<Value> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let mut got = Vec::new();
    for resource in body["resourceSpans"].as_array().into_iter().flatten() {
        let service = resource["resource"]["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["key"] == "service.name")
            .map(|a| text(&a["value"]["stringValue"]))
            .unwrap_or_default();
        for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
            for span in scope["spans"].as_array().into_iter().flatten() {
                got.push(Span {
                    service: service.clone(),
                    name: text(&span["name"]),
                    trace_id: text(&span["traceId"]).to_lowercase(),
                    span_id: text(&span["spanId"]).to_lowercase(),
                    parent_span_id: text(&span["parentSpanId"]).to_lowercase(),
                });
            }
        }
    }
    spans.lock().unwrap().extend(got);
    Json(serde_json::json!({}))
}

/// `program` on the test's database, vhost and configuration, exporting to
/// `otlp` over OTLP/HTTP with JSON, in batches every 100 ms.
fn exporting(program: &str, env: &TestEnv, config: &std::path::Path, otlp: &str) -> Command {
    let mut command = Command::new(binary(program));
    command
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", config)
        // Logs at warn: RUST_LOG must not turn the span export off.
        .env("RUST_LOG", "warn")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp)
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env_remove("OTEL_SERVICE_NAME")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    command
}

fn start(mut command: Command, probes: u16) -> Program {
    let mut program = Program(command.spawn().expect("start the program"));
    listening(probes, &mut program.0);
    program
}

/// The worker (every role) and the gateway, both exporting to `otlp`; the
/// gateway's port.
fn exporting_fleet(env: &TestEnv, config: &std::path::Path, otlp: &str) -> (Program, Program, u16) {
    let (worker_probes, listen, gateway_probes) = (free_port(), free_port(), free_port());
    let mut worker = exporting("onejob-worker", env, config, otlp);
    worker.args(["--http", &format!("127.0.0.1:{worker_probes}")]);
    let worker = start(worker, worker_probes);
    let mut gateway = exporting("onejob-producer", env, config, otlp);
    gateway.args([
        "serve",
        "--listen",
        &format!("127.0.0.1:{listen}"),
        "--http",
        &format!("127.0.0.1:{gateway_probes}"),
    ]);
    let gateway = start(gateway, gateway_probes);

    (worker, gateway, listen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spans_are_exported_over_otlp_as_one_trace_from_the_caller_to_the_provider() {
    let provider = mock(MockOptions::default()).await;
    let (config, file) = config(&config_text(&provider.base_url(), None, ""));
    let env = TestEnv::new(&config).await;
    let (otlp, spans) = collector().await;
    let token = String::from_utf8(
        env.cli_ok(&file.path, &["tokens", "create", "--owner", "acct_t"])
            .stdout,
    )
    .unwrap();
    let (worker, gateway, listen) = exporting_fleet(&env, &file.path, &otlp);

    let answer: Value = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{listen}/v1/jobs"))
        .bearer_auth(token.trim())
        .header("Idempotency-Key", "over-http")
        .header("traceparent", UPSTREAM)
        .header("tracestate", "vendor=abc")
        .json(&serde_json::json!({"operation": "summarize", "input": {"text": "traced"}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let job: uuid::Uuid = answer["job_id"].as_str().unwrap().parse().unwrap();
    wait_for_status(&env, JobId(job), JobStatus::Succeeded).await;
    let call = context_of(&call_seen(&env, &provider, JobId(job)).await);
    assert_eq!(call.trace_id, upstream().trace_id, "the caller's trace");
    assert_eq!(call.state.as_deref(), Some("vendor=abc"));

    let trace = upstream().trace_id_hex();
    let by_name = wait_for("the three spans", Duration::from_secs(30), || async {
        let got: HashMap<String, Span> = spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace)
            .map(|s| (s.name.clone(), s.clone()))
            .collect();
        ["create job", "intake", "attempt"]
            .iter()
            .all(|n| got.contains_key(*n))
            .then_some(got)
    })
    .await;
    let (create, intake, attempt) = (
        &by_name["create job"],
        &by_name["intake"],
        &by_name["attempt"],
    );
    let hex = |id: &[u8]| id.iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert_eq!(
        create.parent_span_id,
        hex(&upstream().span_id),
        "the caller's span"
    );
    assert_eq!(intake.parent_span_id, create.span_id);
    assert_eq!(attempt.parent_span_id, intake.span_id);
    assert_eq!(
        hex(&call.span_id),
        attempt.span_id,
        "the provider's parent is the exported attempt span"
    );
    assert_eq!(create.service, "onejob-producer");
    assert_eq!(
        (intake.service.as_str(), attempt.service.as_str()),
        ("onejob-worker", "onejob-worker")
    );
    drop((gateway, worker));
}
