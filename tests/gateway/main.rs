//! The HTTP gateway (`onejob-producer serve`) over real HTTP, in front of the real
//! RabbitMQ and Postgres: bearer tokens per owner, one job per `Idempotency-Key`
//! however often a request is sent (concurrently too), owners that cannot see
//! each other's jobs, specific errors for bad requests, and answers that match
//! the gateway's own `/openapi.json`.
//!
//! One binary, its tests by topic: tokens (`tokens`), one job per request and
//! each owner's view (`one_job`), bad requests (`bad_requests`), the gateway's
//! own life: its description, shutdown, a lost broker (`lifecycle`), clients
//! that are slow or greedy (`slow_clients`), and an owner over its budget
//! (`limits`).

use onejob_test_support as common;

mod bad_requests;
mod lifecycle;
mod limits;
mod one_job;
mod slow_clients;
mod tokens;

use std::sync::Arc;
use std::time::Duration;

use common::{TestEnv, config, config_text, mock, tempfile_path::TempConfig};
use onejob::domain::JobId;
use onejob::edges::shutdown::Shutdown;
use onejob::mock::MockOptions;
use onejob_producer::gateway::{Gateway, GatewayOptions, OPENAPI};
use reqwest::StatusCode;
use serde_json::Value;

/// A gateway on a free port, with or without a fleet behind it, on one test env.
struct Served {
    env: TestEnv,
    config: Arc<onejob::settings::config::Config>,
    file: TempConfig,
    base: String,
    http: reqwest::Client,
    shutdown: Shutdown,
    server: tokio::task::JoinHandle<onejob_producer::gateway::Result<()>>,
    fleet: Option<common::Fleet>,
    _mock: onejob::mock::MockHandle,
}

impl Served {
    async fn start() -> Served {
        Self::start_with(true, GatewayOptions::default()).await
    }

    async fn start_with(with_fleet: bool, options: GatewayOptions) -> Served {
        let primary = mock(MockOptions::default()).await;
        let (config, file) = config(&config_text(&primary.base_url(), None, ""));
        let env = TestEnv::new(&config).await;
        let fleet = match with_fleet {
            true => Some(env.fleet(config.clone(), vec![]).await),
            false => None,
        };
        let gateway = Gateway::connect(config.clone(), &env.database_url, &env.amqp_url, options)
            .await
            .expect("gateway connects");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let shutdown = Shutdown::new();
        let server = tokio::spawn(Arc::new(gateway).serve(listener, None, shutdown.clone()));
        Served {
            env,
            config,
            file,
            base,
            http: reqwest::Client::new(),
            shutdown,
            server,
            fleet,
            _mock: primary,
        }
    }

    /// A new token for `owner`, through the operator CLI.
    fn token(&self, owner: &str) -> String {
        let out = self
            .env
            .cli_ok(&self.file.path, &["tokens", "create", "--owner", owner]);
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    async fn post(&self, token: Option<&str>, key: Option<&str>, body: &str) -> Answer {
        let mut request = self
            .http
            .post(format!("{}/v1/jobs", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(t) = token {
            request = request.bearer_auth(t);
        }
        if let Some(k) = key {
            request = request.header("Idempotency-Key", k);
        }
        Answer::of(request.send().await.expect("POST /v1/jobs")).await
    }

    /// An unauthenticated GET of `path`.
    async fn fetch(&self, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    async fn get(&self, token: &str, id: &str) -> Answer {
        let response = self
            .http
            .get(format!("{}/v1/jobs/{id}", self.base))
            .bearer_auth(token)
            .send()
            .await
            .expect("GET /v1/jobs/{id}");
        Answer::of(response).await
    }

    async fn stop(self) {
        self.shutdown.trigger();
        tokio::time::timeout(Duration::from_secs(30), self.server)
            .await
            .expect("the gateway stops")
            .expect("gateway task")
            .expect("the gateway served without errors");
        if let Some(fleet) = self.fleet {
            fleet.stop().await;
        }
    }
}

/// An HTTP answer, read whole.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Answer {
    async fn of(response: reqwest::Response) -> Answer {
        let status = response.status();
        let headers = response.headers().clone();
        let text = response.text().await.expect("body");
        let body = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{status}: body is not JSON ({e}): {text}"));
        Answer {
            status,
            headers,
            body,
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn job_id(&self) -> JobId {
        JobId(
            self.body["job_id"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("no job id in {self:?}")),
        )
    }

    /// Asserts the body matches the schema `/openapi.json` gives for this path,
    /// method and status.
    fn conforms(&self, path: &str, method: &str) -> &Self {
        let doc: Value = serde_json::from_str(OPENAPI).unwrap();
        let pointer = format!(
            "/paths/{}/{method}/responses/{}/content/application~1json/schema",
            path.replace('~', "~0").replace('/', "~1"),
            self.status.as_u16()
        );
        let schema = doc
            .pointer(&pointer)
            .unwrap_or_else(|| panic!("/openapi.json documents no {pointer}"));
        let validator =
            jsonschema::validator_for(&with_components(&doc, schema)).expect("the schema compiles");
        let errors: Vec<String> = validator
            .iter_errors(&self.body)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "{method} {path} {}: {} does not match /openapi.json: {errors:?}",
            self.status,
            self.body
        );
        self
    }
}

/// `schema` as a root document that can resolve the OpenAPI document's
/// `#/components/...` references.
fn with_components(doc: &Value, schema: &Value) -> Value {
    let mut root = schema.clone();
    root["components"] = doc["components"].clone();
    root
}

const SUMMARIZE: &str = r#"{"operation":"summarize","input":{"text":"the quick fox"}}"#;
