//! The HTTP gateway (`onejob-producer serve`) over real HTTP, in front of the real
//! RabbitMQ and Postgres: bearer tokens per owner, one job per `Idempotency-Key`
//! however often a request is sent (concurrently too), owners that cannot see
//! each other's jobs, specific errors for bad requests, and answers that match
//! the gateway's own `/openapi.json`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestEnv, config, config_text, mock, tempfile_path::TempConfig, wait_for};
use futures_util::future::join_all;
use onejob::domain::JobId;
use onejob::mock::MockOptions;
use onejob::shutdown::Shutdown;
use onejob_producer::gateway::{Gateway, GatewayOptions, OPENAPI};
use reqwest::StatusCode;
use serde_json::{Value, json};

/// A gateway on a free port, with or without a fleet behind it, on one test env.
struct Served {
    env: TestEnv,
    config: Arc<onejob::config::Config>,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_are_shown_once_and_only_their_digest_is_kept() {
    let s = Served::start().await;
    let out = s.env.cli_ok(
        &s.file.path,
        &["tokens", "create", "--owner", "acct_1", "--json"],
    );
    let created: Value = serde_json::from_slice(&out.stdout).unwrap();
    let keys: Vec<&str> = created
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys, ["owner_id", "token"], "the contract's shape exactly");
    assert_eq!(created["owner_id"], "acct_1");
    let token = created["token"].as_str().unwrap().to_owned();
    assert!(onejob::token::Token::parse(&token).is_some(), "{token}");

    // The database holds no trace of the token itself.
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT owner_id, token_sha256 FROM gateway_tokens")
            .fetch_all(s.env.store.pool())
            .await
            .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].0, "acct_1");
    assert_ne!(rows[0].1, token);
    assert!(!rows[0].1.contains(&token[4..]));

    // Text mode prints the token alone on stdout; listing never shows it.
    let second = s.token("acct_1");
    assert!(onejob::token::Token::parse(&second).is_some(), "{second}");
    let out = s.env.cli_ok(&s.file.path, &["tokens", "list", "--json"]);
    let listed = String::from_utf8(out.stdout).unwrap();
    assert!(!listed.contains(&token[4..]) && !listed.contains(&second[4..]));
    let listed: Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2);

    // Both work; revoking one stops it at its next request, not the other.
    assert_eq!(
        s.post(Some(&token), Some("k-1"), SUMMARIZE).await.status,
        StatusCode::CREATED
    );
    let id = listed[0]["id"].as_str().unwrap();
    let out = s.env.cli_ok(&s.file.path, &["tokens", "revoke", id]);
    assert!(String::from_utf8_lossy(&out.stdout).ends_with("revoked\n"));
    let again = s.env.cli_ok(&s.file.path, &["tokens", "revoke", id]);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("was already revoked on"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
    let refused = s.post(Some(&token), Some("k-1"), SUMMARIZE).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        s.post(Some(&second), Some("k-1"), SUMMARIZE).await.status,
        StatusCode::OK
    );
    let out = s.env.cli_ok(
        &s.file.path,
        &["tokens", "list", "--owner", "acct_1", "--json"],
    );
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(listed[0]["revoked_at"].is_string() && listed[1]["revoked_at"].is_null());

    // Refusals: a bad owner, an unknown token id.
    let out = s
        .env
        .cli(&s.file.path, &["tokens", "create", "--owner", "not ok"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad_characters"));
    let out = s.env.cli(
        &s.file.path,
        &["tokens", "revoke", &uuid::Uuid::now_v7().to_string()],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_is_one_job_however_often_and_however_concurrently_it_is_sent() {
    let s = Served::start().await;
    let token = s.token("acct_1");

    let first = s.post(Some(&token), Some("k-0"), SUMMARIZE).await;
    first.conforms("/v1/jobs", "post");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.body["outcome"], "created");
    let job_id = first.job_id();
    assert_eq!(
        first.header("location"),
        Some(format!("/v1/jobs/{job_id}").as_str())
    );

    // The same request again, with its keys reordered and spaced: a duplicate.
    let again = s
        .post(
            Some(&token),
            Some("k-0"),
            r#"{ "input" : { "text" : "the quick fox" },
                 "operation" : "summarize" }"#,
        )
        .await;
    again.conforms("/v1/jobs", "post");
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.body["outcome"], "duplicate");
    assert_eq!(again.job_id(), job_id);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));

    // Double clicks: many identical requests racing on fresh keys, round after round.
    for round in 1..=3 {
        let key = format!("k-{round}");
        let answers = join_all((0..20).map(|_| s.post(Some(&token), Some(&key), SUMMARIZE))).await;
        let created = answers
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .count();
        let replayed = answers
            .iter()
            .filter(|a| a.status == StatusCode::OK)
            .count();
        assert_eq!((created, replayed), (1, 19), "round {round}: {answers:?}");
        let ids: std::collections::BTreeSet<JobId> = answers.iter().map(Answer::job_id).collect();
        assert_eq!(ids.len(), 1, "round {round}: one job for all of them");
        let (jobs,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM jobs WHERE owner_id = 'acct_1' AND idempotency_key = $1",
        )
        .bind(&key)
        .fetch_one(s.env.store.pool())
        .await
        .unwrap();
        assert_eq!(jobs, 1);
    }

    // The same key for a different request: a conflict that reveals nothing.
    let conflict = s
        .post(
            Some(&token),
            Some("k-0"),
            r#"{"operation":"summarize","input":{"text":"something else"}}"#,
        )
        .await;
    conflict.conforms("/v1/jobs", "post");
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(conflict.body["outcome"], "conflict");
    assert!(conflict.body["job_id"].is_null());
    assert!(
        conflict.body["error"]
            .as_str()
            .unwrap()
            .starts_with("conflict: Idempotency-Key \"k-0\"")
    );

    // The owner watches the job succeed.
    let done = wait_for(
        "the job to succeed over HTTP",
        Duration::from_secs(20),
        || async {
            let a = s.get(&token, &job_id.to_string()).await;
            (a.body["status"] == "succeeded").then_some(a)
        },
    )
    .await;
    done.conforms("/v1/jobs/{id}", "get");
    assert_eq!(
        done.body["result"]["summary"],
        "mock answer: Summarize: the quick fox"
    );
    assert_eq!(done.body["owner_id"], "acct_1");
    assert_eq!(done.body["attempts"][0]["status"], "succeeded");
    // The owner's view, not the operator's: no usage, request ids or fingerprints
    // (the schema allows no other field, and `conforms` checked it).
    for internal in ["request_fingerprint", "completed_by"] {
        assert!(done.body.get(internal).is_none(), "{internal} shown");
    }
    assert!(done.body["attempts"][0].get("usage").is_none());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_see_only_their_own_jobs() {
    let s = Served::start().await;
    let alice = s.token("alice");
    let bob = s.token("bob");

    // The same key under two owners: two identities, two jobs.
    let a = s.post(Some(&alice), Some("shared-key"), SUMMARIZE).await;
    let b = s.post(Some(&bob), Some("shared-key"), SUMMARIZE).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_ne!(a.job_id(), b.job_id());

    let mine = s.get(&alice, &a.job_id().to_string()).await;
    assert_eq!(mine.status, StatusCode::OK);
    mine.conforms("/v1/jobs/{id}", "get");
    // Bob's view of Alice's job is the same as of a job that does not exist.
    let theirs = s.get(&bob, &a.job_id().to_string()).await;
    let missing = s.get(&bob, &uuid::Uuid::now_v7().to_string()).await;
    let garbage = s.get(&bob, "not-a-uuid").await;
    for answer in [&theirs, &missing, &garbage] {
        assert_eq!(answer.status, StatusCode::NOT_FOUND, "{answer:?}");
        answer.conforms("/v1/jobs/{id}", "get");
        assert!(
            answer.body["error"]
                .as_str()
                .unwrap()
                .starts_with("not_found")
        );
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_specific_errors_and_publish_nothing() {
    let s = Served::start().await;
    let token = s.token("acct_1");
    let unknown_token = onejob::token::Token::generate();
    let long_key = "k".repeat(256);

    // (token, Idempotency-Key, body, expected status, expected error code)
    type Case<'a> = (
        Option<&'a str>,
        Option<&'a str>,
        String,
        StatusCode,
        &'a str,
    );
    let cases: Vec<Case<'_>> = vec![
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
            Some(unknown_token.reveal()),
            Some("k"),
            SUMMARIZE.into(),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            Some(&token),
            None,
            SUMMARIZE.into(),
            StatusCode::BAD_REQUEST,
            "missing_idempotency_key",
        ),
        (
            Some(&token),
            Some("k"),
            "not json".into(),
            StatusCode::BAD_REQUEST,
            "invalid_json",
        ),
        (
            Some(&token),
            Some("k"),
            "[]".into(),
            StatusCode::BAD_REQUEST,
            "not_an_object",
        ),
        (
            Some(&token),
            Some("k"),
            r#"{"operation":"summarize","input":{"text":"a","text":"b"}}"#.into(),
            StatusCode::BAD_REQUEST,
            "duplicate_field",
        ),
        (
            Some(&token),
            Some("k"),
            r#"{"operation":"summarize","input":{"text":"a","n":9007199254740993}}"#.into(),
            StatusCode::BAD_REQUEST,
            "bad_number",
        ),
        (
            Some(&token),
            Some("k"),
            r#"{"owner_id":"someone_else","operation":"summarize","input":{}}"#.into(),
            StatusCode::BAD_REQUEST,
            "unknown_field",
        ),
        (
            Some(&token),
            Some("k"),
            r#"{"operation":"nope","input":{}}"#.into(),
            StatusCode::BAD_REQUEST,
            "unknown_operation",
        ),
        (
            Some(&token),
            Some("k"),
            r#"{"operation":"summarize","input":{},"provider":"elsewhere"}"#.into(),
            StatusCode::BAD_REQUEST,
            "provider_not_in_route",
        ),
        (
            Some(&token),
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
            Some(&token),
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
        (
            Some(&token),
            Some(&long_key),
            SUMMARIZE.into(),
            StatusCode::BAD_REQUEST,
            "bad_length",
        ),
    ];
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
    // Nothing reached the fleet: no job, no dead letter. A good request after
    // them is answered once intake made its job; then intake is left to settle
    // every message published before it (the intents queue holds none, ready
    // or unacked: each was admitted or dead-lettered, and acked), and only
    // then is the fleet's work counted.
    let marker = s
        .post(Some(&token), Some("after-the-bad-ones"), SUMMARIZE)
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
    s.stop().await;
}

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
async fn the_bearer_scheme_is_case_insensitive() {
    let s = Served::start().await;
    let token = s.token("acct_1");
    for (i, scheme) in ["bearer", "BEARER", "Bearer"].iter().enumerate() {
        let response = s
            .http
            .post(format!("{}/v1/jobs", s.base))
            .header("authorization", format!("{scheme} {token}"))
            .header("idempotency-key", format!("k-{i}"))
            .body(SUMMARIZE)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "{scheme}");
    }
    let basic = s
        .http
        .post(format!("{}/v1/jobs", s.base))
        .header("authorization", format!("Basic {token}"))
        .header("idempotency-key", "k-basic")
        .body(SUMMARIZE)
        .send()
        .await
        .unwrap();
    assert_eq!(basic.status(), StatusCode::UNAUTHORIZED);
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

/// Item 14 of issue 8: the owner's view of a failed job says what went wrong in
/// onejob's words, as a stable code and a short message, never the provider's
/// own error text (which the operator CLI still shows).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_see_a_stable_error_code_not_provider_internals() {
    let s = Served::start().await;
    let alice = s.token("alice");
    let body = r#"{"operation":"summarize","input":{"text":"mock:status=401"}}"#;
    let created = s.post(Some(&alice), Some("refused"), body).await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    let job_id = created.job_id();
    common::wait_for_status(&s.env, job_id, onejob::domain::JobStatus::Failed).await;

    let seen = s.get(&alice, &job_id.to_string()).await;
    assert_eq!(seen.status, StatusCode::OK);
    seen.conforms("/v1/jobs/{id}", "get");
    assert_eq!(
        seen.body["error"]["code"], "provider_error",
        "{}",
        seen.body
    );
    assert!(
        seen.body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
    let text = seen.body.to_string();
    for internal in ["HTTP 401", "asked to fail", "mock_error"] {
        assert!(
            !text.contains(internal),
            "{internal:?} shown to the owner: {text}"
        );
    }
    // The operator still sees the provider's own words.
    let operator = s.env.cli_ok(
        &s.file.path,
        &["jobs", "show", &job_id.to_string(), "--json"],
    );
    assert!(String::from_utf8_lossy(&operator.stdout).contains("HTTP 401"));
    s.stop().await;
}

/// A raw connection to the gateway that sends `head` and then nothing.
async fn stalled(base: &str, head: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut c = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .unwrap();
    c.write_all(head.as_bytes()).await.unwrap();
    c
}

/// Reads what the gateway says on `c` until it closes the connection.
async fn until_closed(c: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf).await {
            Ok(0) | Err(_) => return String::from_utf8_lossy(&all).into_owned(),
            Ok(n) => all.extend_from_slice(&buf[..n]),
        }
    }
}

/// 300 connections that send half a request line and stop are each closed
/// once the header timeout passes, whatever the connection limit lets in at
/// once; and a client that sends whole requests is served, during and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_headers_are_cut_off_and_hold_no_connection() {
    let options = GatewayOptions {
        header_timeout: Duration::from_secs(1),
        max_connections: 64,
        ..GatewayOptions::default()
    };
    let s = Served::start_with(false, options).await;
    let mut slow = Vec::new();
    for _ in 0..300 {
        slow.push(stalled(&s.base, "POST /v1/jo").await);
    }
    let served = tokio::spawn({
        let http = s.http.clone();
        let url = format!("{}/healthz", s.base);
        async move { http.get(url).send().await.map(|r| r.status()) }
    });
    let closed = join_all(
        slow.iter_mut()
            .map(|c| tokio::time::timeout(Duration::from_secs(60), until_closed(c))),
    )
    .await;
    let open = closed.iter().filter(|c| c.is_err()).count();
    assert_eq!(open, 0, "{open} of 300 slow connections were never closed");
    assert_eq!(served.await.unwrap().unwrap(), StatusCode::OK);
    // A new connection: the client's kept-alive one is closed once idle past
    // the header timeout, as it should be.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let after = fresh
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), StatusCode::OK);
    s.stop().await;
}

/// A body that stops arriving is answered `408 request_timeout` once the body
/// timeout passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_that_stops_arriving_is_answered_408() {
    let options = GatewayOptions {
        body_timeout: Duration::from_secs(1),
        ..GatewayOptions::default()
    };
    let s = Served::start_with(false, options).await;
    let token = s.token("acct_slow");
    let mut c = stalled(
        &s.base,
        &format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
             Idempotency-Key: k-slow\r\nContent-Type: application/json\r\n\
             Content-Length: 1000\r\n\r\n{{\"operation\""
        ),
    )
    .await;
    // Well before the 30 s default: the setting holds.
    let answer = tokio::time::timeout(Duration::from_secs(20), until_closed(&mut c))
        .await
        .expect("an answer");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    s.stop().await;
}

/// While one owner holds many slow requests open, another owner is served:
/// what one owner may hold at once (requests, and bytes declared in flight) is
/// bounded, and each refusal is counted for its owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_owner_cannot_starve_another() {
    let options = GatewayOptions {
        max_in_flight: 64,
        max_in_flight_per_owner: 8,
        max_bytes_in_flight_per_owner: 64 << 10,
        body_timeout: Duration::from_secs(10),
        ..GatewayOptions::default()
    };
    let s = Served::start_with(true, options).await;
    let greedy = s.token("acct_greedy");
    let polite = s.token("acct_polite");
    let head = |key: usize, length: usize| {
        format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {greedy}\r\n\
             Idempotency-Key: k-{key}\r\nContent-Type: application/json\r\n\
             Content-Length: {length}\r\n\r\n"
        )
    };
    // Seven requests that declare 8 KiB each and send nothing: 56 KiB of the
    // owner's 64 KiB held.
    let mut held = Vec::new();
    for key in 0..7 {
        held.push(stalled(&s.base, &head(key, 8 << 10)).await);
    }
    wait_for("the seven to be held", Duration::from_secs(30), || async {
        onejob::metrics::render()
            .contains("onejob_gateway_in_flight 7")
            .then_some(())
    })
    .await;
    // One more of 16 KiB would pass the bytes budget, though it is under the
    // request limit: refused at once, with why.
    let mut big = stalled(&s.base, &head(7, 16 << 10)).await;
    let answer = tokio::time::timeout(Duration::from_secs(30), until_closed(&mut big))
        .await
        .expect("a refusal, not a wait");
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(answer.contains("bytes in flight"), "{answer}");

    // 93 small ones: one takes the owner's eighth place, the other 92 are
    // refused at once.
    let (answers, mut refusals) = tokio::sync::mpsc::unbounded_channel();
    for key in 100..193 {
        let mut c = stalled(&s.base, &head(key, 100)).await;
        let answers = answers.clone();
        tokio::spawn(async move {
            let answer = until_closed(&mut c).await;
            let _ = answers.send(answer);
            c
        });
    }
    for _ in 0..92 {
        let answer = tokio::time::timeout(Duration::from_secs(30), refusals.recv())
            .await
            .expect("92 refusals, not waits")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
        assert!(answer.contains("too_many_requests"), "{answer}");
    }
    // Another owner is served meanwhile.
    let answer = s.post(Some(&polite), Some("k-polite"), SUMMARIZE).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");

    let metrics = onejob::metrics::render();
    for reason in ["requests", "bytes"] {
        let line = format!(
            "onejob_gateway_refused_total{{owner=\"acct_greedy\",reason=\"{reason}_in_flight\"}}"
        );
        assert!(metrics.contains(&line), "{line} in:\n{metrics}");
    }
    assert!(!metrics.contains("owner=\"acct_polite\""), "{metrics}");
    drop(held);
    s.stop().await;
}
