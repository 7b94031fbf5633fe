//! The bundled OpenAI-compatible mock provider, for tests, the quick start and
//! compose. It serves `POST /v1/chat/completions` and answers with a JSON object
//! `{"<field>": "..."}` (the field is `summary` unless configured otherwise).
//!
//! Started with directives allowed ([`MockOptions::directives`],
//! `onejob-mock-provider --directives`), each request can steer it with
//! directives anywhere in its messages' text. The text is a tenant's prompt,
//! so they are off by default, and clamped when on:
//!
//! | directive | effect |
//! |---|---|
//! | `mock:delay=MS` | wait MS milliseconds (at most a minute) before answering |
//! | `mock:status=CODE` | answer with that HTTP status (100 to 599) and an error body |
//! | `mock:retry_after=S` | with a status, send `Retry-After: S` (at most an hour) |
//! | `mock:prose` | answer with prose instead of JSON |
//! | `mock:extra_key` | add a top-level key the schema does not allow |
//! | `mock:wrong_type` | give the field a number instead of a string |
//! | `mock:drop` | send the headers, then drop the connection mid-body |
//! | `mock:nul` | put NUL characters in the answer, its id and usage (and a raw NUL byte in an error body) |
//! | `mock:pad=BYTES` | pad the answer's text (or an error's message) with that many bytes (at most [`MAX_PAD`]) |
//!
//! Server-wide options add a fixed delay, random latency and a random error rate.
//! `GET /_mock/stats` reports how many completions were requested, and with which
//! `Idempotency-Key`s (the latest [`MockOptions::record_limit`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Server-wide behaviour.
#[derive(Clone, Debug)]
pub struct MockOptions {
    /// The answer object's field.
    pub field: String,
    /// A delay before every answer.
    pub delay: Duration,
    /// Extra random latency, up to this much.
    pub jitter: Duration,
    /// The share of requests answered with HTTP 503, from 0.0 to 1.0.
    pub error_rate: f64,
    /// Break the output contract on every answer, as a badly behaved provider does.
    pub misbehave: Option<Misbehaviour>,
    /// Names this mock in its answers (`mock answer: from TAG: …`), to tell apart
    /// which provider's result won.
    pub tag: Option<String>,
    /// Whether `mock:` directives in a request's text are obeyed. Off by
    /// default: the text is a tenant's prompt.
    pub directives: bool,
    /// How many idempotency keys and authorizations are kept (the latest).
    pub record_limit: usize,
}

/// The most a `mock:pad` pads, in bytes.
pub const MAX_PAD: usize = 1 << 20;

/// The longest a `mock:delay` waits, in milliseconds.
const MAX_DELAY_MS: u64 = 60_000;

/// The longest `Retry-After` a `mock:retry_after` sends, in seconds.
const MAX_RETRY_AFTER_S: u64 = 3_600;

/// How a badly behaved mock breaks the output contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Misbehaviour {
    /// Prose instead of JSON.
    Prose,
    /// An extra top-level key.
    ExtraKey,
    /// A number where the schema wants a string.
    WrongType,
}

impl Default for MockOptions {
    fn default() -> Self {
        Self {
            field: "summary".into(),
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            error_rate: 0.0,
            misbehave: None,
            tag: None,
            directives: false,
            record_limit: 100_000,
        }
    }
}

/// What the mock has seen.
#[derive(Debug, Default, Serialize)]
pub struct Stats {
    requests: AtomicU64,
    idempotency_keys: Mutex<VecDeque<String>>,
    #[serde(skip)]
    authorizations: Mutex<VecDeque<String>>,
}

impl Stats {
    /// Completions requested so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// The `Authorization` header of each request that had one, so tests can check
    /// an API key was sent (it is never served by `/_mock/stats`).
    pub fn authorizations(&self) -> Vec<String> {
        self.authorizations
            .lock()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The `Idempotency-Key` of each request, in arrival order.
    pub fn idempotency_keys(&self) -> Vec<String> {
        self.idempotency_keys
            .lock()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[derive(Clone)]
struct AppState {
    options: Arc<RwLock<MockOptions>>,
    stats: Arc<Stats>,
}

/// A running mock.
#[derive(Debug)]
pub struct MockHandle {
    /// Where it listens.
    pub addr: SocketAddr,
    /// What it has seen.
    pub stats: Arc<Stats>,
    options: Arc<RwLock<MockOptions>>,
    task: tokio::task::JoinHandle<()>,
}

impl MockHandle {
    /// The base URL to configure a provider with.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Changes its server-wide behaviour from now on.
    pub fn configure(&self, change: impl FnOnce(&mut MockOptions)) {
        if let Ok(mut o) = self.options.write() {
            change(&mut o);
        }
    }
}

impl Drop for MockHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts a mock on `addr` (port 0 picks a free port) in the current runtime.
pub async fn start(addr: SocketAddr, options: MockOptions) -> std::io::Result<MockHandle> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let stats = Arc::new(Stats::default());
    let options = Arc::new(RwLock::new(options));
    let app = router(options.clone(), stats.clone());
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "mock provider stopped");
        }
    });
    Ok(MockHandle {
        addr,
        stats,
        options,
        task,
    })
}

/// The mock's routes.
fn router(options: Arc<RwLock<MockOptions>>, stats: Arc<Stats>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(complete))
        .route("/_mock/stats", get(stats_handler))
        .with_state(AppState { options, stats })
}

async fn stats_handler(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "requests": state.stats.requests(),
        "idempotency_keys": state.stats.idempotency_keys(),
    }))
}

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default)]
    messages: Vec<ChatMessage>,
}

#[derive(Deserialize)]
struct ChatMessage {
    #[serde(default)]
    content: String,
}

/// Directives found in a request's text.
#[derive(Debug, Default, PartialEq)]
struct Directives {
    delay: Option<u64>,
    status: Option<u16>,
    retry_after: Option<u64>,
    prose: bool,
    extra_key: bool,
    wrong_type: bool,
    drop: bool,
    nul: bool,
    pad: Option<usize>,
}

fn directives(text: &str) -> Directives {
    let mut d = Directives::default();
    for word in text.split(|c: char| c.is_whitespace() || c == '"' || c == ',') {
        let Some(rest) = word.strip_prefix("mock:") else {
            continue;
        };
        let (name, value) = rest.split_once('=').unwrap_or((rest, ""));
        match name {
            "delay" => d.delay = value.parse::<u64>().ok().map(|ms| ms.min(MAX_DELAY_MS)),
            "status" => d.status = value.parse().ok().filter(|c| (100..=599).contains(c)),
            "retry_after" => {
                d.retry_after = value.parse::<u64>().ok().map(|s| s.min(MAX_RETRY_AFTER_S));
            }
            "prose" => d.prose = true,
            "extra_key" => d.extra_key = true,
            "wrong_type" => d.wrong_type = true,
            "drop" => d.drop = true,
            "nul" => d.nul = true,
            "pad" => {
                d.pad = value
                    .parse::<u64>()
                    .ok()
                    .map(|p| p.min(MAX_PAD as u64) as usize)
            }
            _ => {}
        }
    }
    d
}

async fn complete(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let options = state.options.read().map(|o| o.clone()).unwrap_or_default();
    let n = state.stats.record(&headers, options.record_limit);
    let request: ChatRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": {"message": format!("bad request: {e}")}})),
            )
                .into_response();
        }
    };
    let text: String = request
        .messages
        .iter()
        .map(|m| m.content.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let d = if options.directives {
        directives(&text)
    } else {
        Directives::default()
    };
    let fail = wait(&options, &d).await;
    if let Some(code) = d.status.or(if fail { Some(503) } else { None }) {
        return failure(code, &d);
    }
    if d.drop {
        return dropped();
    }
    let user = request
        .messages
        .last()
        .map(|m| m.content.as_str())
        .unwrap_or_default();
    answer(n, &options, d, &text, user)
}

impl Stats {
    /// Counts a request and keeps its idempotency key and authorization (the
    /// latest `limit` of each); returns its number.
    fn record(&self, headers: &HeaderMap, limit: usize) -> u64 {
        let n = self.requests.fetch_add(1, Ordering::SeqCst) + 1;
        let keep = |kept: &Mutex<VecDeque<String>>, name: &str| {
            if let Some(value) = headers.get(name).and_then(|v| v.to_str().ok())
                && let Ok(mut kept) = kept.lock()
            {
                kept.push_back(value.to_owned());
                while kept.len() > limit {
                    kept.pop_front();
                }
            }
        };
        keep(&self.idempotency_keys, "idempotency-key");
        keep(&self.authorizations, "authorization");
        n
    }
}

/// Waits the asked or configured delay plus jitter; returns whether the
/// server-wide error rate picked this request to fail.
async fn wait(options: &MockOptions, d: &Directives) -> bool {
    let (jitter_ms, fail) = {
        let mut rng = rand::rng();
        let jitter_ms = match options.jitter.as_millis() {
            0 => 0,
            max => rng.random_range(0..=max as u64),
        };
        (
            jitter_ms,
            options.error_rate > 0.0 && rng.random_bool(options.error_rate.min(1.0)),
        )
    };
    let delay = d.delay.map(Duration::from_millis).unwrap_or(options.delay)
        + Duration::from_millis(jitter_ms);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    fail
}

/// An error answer with status `code` (`mock:status`, or the error rate).
fn failure(code: u16, d: &Directives) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = if d.nul {
        (status, b"mock: a raw \0 byte in an error body".to_vec()).into_response()
    } else {
        (
            status,
            Json(json!({"error": {"message": format!("mock: asked to fail with {code}{}", "x".repeat(d.pad.unwrap_or(0))), "type": "mock_error"}})),
        )
            .into_response()
    };
    if let Some(secs) = d.retry_after
        && let Ok(v) = secs.to_string().parse()
    {
        response.headers_mut().insert("retry-after", v);
    }
    response
}

/// A 200 whose body breaks off: the connection drops mid-answer (`mock:drop`).
fn dropped() -> Response {
    let stream = futures_util::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("mock: dropping the connection"))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The chat completion: a JSON answer about the last message, or one that
/// misbehaves as the directives or the server's options ask.
fn answer(n: u64, options: &MockOptions, d: Directives, text: &str, user: &str) -> Response {
    let usage = json!({
        "prompt_tokens": text.split_whitespace().count(),
        "completion_tokens": 12,
        "total_tokens": text.split_whitespace().count() + 12,
    });
    let mut gist: String = user.chars().take(80).collect();
    if d.nul {
        gist.push('\0');
    }
    if let Some(pad) = d.pad {
        gist.push_str(&"x".repeat(pad));
    }
    let gist = match &options.tag {
        Some(tag) => format!("from {tag}: {gist}"),
        None => gist,
    };
    let d = Directives {
        prose: d.prose || options.misbehave == Some(Misbehaviour::Prose),
        extra_key: d.extra_key || options.misbehave == Some(Misbehaviour::ExtraKey),
        wrong_type: d.wrong_type || options.misbehave == Some(Misbehaviour::WrongType),
        ..d
    };
    let content = if d.prose {
        format!("Sure! Here is a summary: {gist}")
    } else {
        let mut answer = serde_json::Map::new();
        let value = if d.wrong_type {
            json!(42)
        } else {
            json!(format!("mock answer: {gist}"))
        };
        answer.insert(options.field.clone(), value);
        if d.extra_key {
            answer.insert("confidence".into(), json!(0.9));
        }
        Value::Object(answer).to_string()
    };
    let (id, usage) = if d.nul {
        let mut usage = usage;
        usage["note"] = json!("spent\0");
        (format!("chatcmpl-mock-{n}\0"), usage)
    } else {
        (format!("chatcmpl-mock-{n}"), usage)
    };
    Json(json!({
        "id": id,
        "object": "chat.completion",
        "model": "mock-model",
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": content },
            "finish_reason": "stop",
        }],
        "usage": usage,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_are_found_in_text() {
        let d = directives(
            "Summarize: hello mock:delay=250 mock:status=503, \"mock:drop\" mock:unknown",
        );
        assert_eq!(
            d,
            Directives {
                delay: Some(250),
                status: Some(503),
                drop: true,
                ..Directives::default()
            }
        );
        assert_eq!(directives("nothing here"), Directives::default());
    }
}
