//! The bundled mock provider, for tests, the quick start and compose. It
//! speaks both kinds' wire formats: OpenAI's (`POST /v1/chat/completions`)
//! and Anthropic's Messages API (`POST /v1/messages`), and answers either
//! with a JSON object `{"<field>": "..."}` (the field is `summary` unless
//! configured otherwise), in that format's shape (see `format`).
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
//! `GET /_mock/stats` reports how many completions were requested, how many of
//! them ran work (a replayed key runs none), how many came without
//! `max_tokens` (an answer reports at most that many completion tokens), and
//! with which `Idempotency-Key`s (the latest [`MockOptions::record_limit`]).
//!
//! It can keep the evidence a real provider keeps (see `evidence`): stored
//! completions, listed by metadata ([`MockOptions::store`]), and answers
//! replayed by idempotency key ([`MockOptions::replay`]).
//!
//! It serves both kinds' batch APIs too (see `batches`): OpenAI's Files and
//! Batches, and Anthropic's Message Batches, each line run by the same work
//! as a live request.

mod answer;
mod batches;
mod directives;
mod evidence;
mod format;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use format::Format;
use serde::Serialize;
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
    /// How many idempotency keys, authorizations and trace contexts are kept (the latest),
    /// and how many stored completions and replayable keys.
    pub record_limit: usize,
    /// Keep every completion asked with `"store": true` (with its
    /// `metadata`), even when the client hung up before the answer, and list
    /// them by metadata: OpenAI's stored completions.
    pub store: bool,
    /// Answer a repeated `Idempotency-Key` with the first request's outcome,
    /// running no new work (`409` while the first is still running).
    pub replay: bool,
    /// The most stored completions one page of a listing holds (at most
    /// 100, OpenAI's most): a client must page on with `after`.
    pub list_page: usize,
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
            store: false,
            replay: false,
            list_page: 100,
        }
    }
}

/// What the mock has seen.
#[derive(Debug, Default, Serialize)]
pub struct Stats {
    requests: AtomicU64,
    work: AtomicU64,
    /// Work running now, and the most that ever ran at once.
    running: AtomicU64,
    most_running: AtomicU64,
    /// Completions requested without `max_tokens`.
    uncapped: AtomicU64,
    /// Batch lines whose work ran.
    batch_work: AtomicU64,
    /// The `custom_id` of every batch line taken, in arrival order.
    batch_custom_ids: Mutex<VecDeque<String>>,
    idempotency_keys: Mutex<VecDeque<String>>,
    #[serde(skip)]
    authorizations: Mutex<VecDeque<String>>,
    traces: Mutex<VecDeque<TraceSeen>>,
}

/// One piece of work counted as running ([`Stats::most_running`]).
struct Running(Arc<Stats>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The W3C trace context of a request, with its idempotency key.
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq, Eq)]
pub struct TraceSeen {
    /// The request's `Idempotency-Key` (the attempt id), if it had one.
    pub idempotency_key: Option<String>,
    /// Its `traceparent` header, if it had one.
    pub traceparent: Option<String>,
    /// Its `tracestate` header, if it had one.
    pub tracestate: Option<String>,
}

impl Stats {
    /// Completions requested so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// Completions whose work ran: every request but a replayed key's.
    pub fn work(&self) -> u64 {
        self.work.load(Ordering::SeqCst)
    }

    /// The most work that ever ran at once. Work whose outcome is kept or
    /// told runs to its end however soon its client hangs up, as a real
    /// provider's does; other work ends with its request.
    pub fn most_running(&self) -> u64 {
        self.most_running.load(Ordering::SeqCst)
    }

    /// Completions requested without `max_tokens` (onejob sends it on every
    /// call, qualification's included).
    pub fn uncapped(&self) -> u64 {
        self.uncapped.load(Ordering::SeqCst)
    }

    /// Batch lines whose work ran (a line that expired, was cancelled or
    /// could not be read ran none).
    pub fn batch_work(&self) -> u64 {
        self.batch_work.load(Ordering::SeqCst)
    }

    /// The `custom_id` of every line of every batch taken, in arrival
    /// order (the latest [`MockOptions::record_limit`]): a line uploaded
    /// twice is here twice.
    pub fn batch_custom_ids(&self) -> Vec<String> {
        self.batch_custom_ids
            .lock()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Keeps the `custom_id`s of a batch's lines (the latest `limit`).
    fn batch_lines_seen(&self, lines: &[batches::Line], limit: usize) {
        if let Ok(mut kept) = self.batch_custom_ids.lock() {
            kept.extend(lines.iter().map(|l| l.custom_id.clone()));
            while kept.len() > limit {
                kept.pop_front();
            }
        }
    }

    /// Counts one piece of work as running until the guard is dropped.
    fn running(self: &Arc<Self>) -> Running {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_running.fetch_max(now, Ordering::SeqCst);
        Running(self.clone())
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

    /// The trace context of each request, in arrival order.
    pub fn traces(&self) -> Vec<TraceSeen> {
        self.traces
            .lock()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[derive(Clone)]
struct AppState {
    options: Arc<RwLock<MockOptions>>,
    stats: Arc<Stats>,
    evidence: Arc<evidence::Evidence>,
    batches: Arc<batches::Batches>,
}

/// The server-wide behaviour now.
fn options_of(state: &AppState) -> MockOptions {
    state.options.read().map(|o| o.clone()).unwrap_or_default()
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
        .route("/v1/chat/completions", post(complete).get(evidence::list))
        .route("/v1/chat/completions/{id}", get(evidence::read))
        .route("/v1/messages", post(messages))
        .route(
            "/v1/files",
            post(batches::openai::upload)
                .layer(DefaultBodyLimit::max(batches::openai::MAX_FILE_BYTES)),
        )
        .route("/v1/files/{id}", get(batches::openai::file))
        .route("/v1/files/{id}/content", get(batches::openai::content))
        .route(
            "/v1/batches",
            post(batches::openai::create).get(batches::openai::list),
        )
        .route("/v1/batches/{id}", get(batches::openai::read))
        .route("/v1/batches/{id}/cancel", post(batches::openai::cancel))
        .route(
            "/v1/messages/batches",
            post(batches::anthropic::create)
                .get(batches::anthropic::list)
                .layer(DefaultBodyLimit::max(batches::openai::MAX_FILE_BYTES)),
        )
        .route("/v1/messages/batches/{id}", get(batches::anthropic::read))
        .route(
            "/v1/messages/batches/{id}/cancel",
            post(batches::anthropic::cancel),
        )
        .route(
            "/v1/messages/batches/{id}/results",
            get(batches::anthropic::results),
        )
        .route("/_mock/stats", get(stats_handler))
        .with_state(AppState {
            options,
            stats,
            evidence: Arc::default(),
            batches: Arc::default(),
        })
}

async fn stats_handler(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "requests": state.stats.requests(),
        "work": state.stats.work(),
        "uncapped": state.stats.uncapped(),
        "batch_work": state.stats.batch_work(),
        "batch_custom_ids": state.stats.batch_custom_ids(),
        "idempotency_keys": state.stats.idempotency_keys(),
        "traces": state.stats.traces(),
    }))
}

/// What a request asks, whatever its wire format.
struct Asked {
    /// All its messages' text (the system prompt's included), where
    /// directives are looked for.
    text: String,
    /// The last message's text, which the answer is about.
    user: String,
    max_tokens: Option<u64>,
    /// The metadata to keep it with, when it asked to be stored.
    stored: Option<Value>,
}

async fn complete(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    match format::OpenAi::asked(&body) {
        Ok(asked) => serve(state, &headers, asked, Format::OpenAi).await,
        Err(e) => Format::OpenAi.refuse(&e),
    }
}

async fn messages(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    match format::Anthropic::asked(&headers, &body) {
        Ok(asked) => serve(state, &headers, asked, Format::Anthropic).await,
        Err(e) => Format::Anthropic.refuse(&e),
    }
}

/// Answers what a request asks, in its wire format.
async fn serve(state: AppState, headers: &HeaderMap, asked: Asked, format: Format) -> Response {
    let options = options_of(&state);
    let n = state.stats.record(headers, options.record_limit);
    let Asked {
        text,
        user,
        max_tokens,
        stored,
    } = asked;
    let mut d = if options.directives {
        directives::directives(&text)
    } else {
        directives::Directives::default()
    };
    d.max_tokens = max_tokens;
    if max_tokens.is_none() {
        state.stats.uncapped.fetch_add(1, Ordering::SeqCst);
    }
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
    let tell = match key.filter(|_| options.replay) {
        Some(key) => match state.evidence.key(key, options.record_limit) {
            evidence::Seen::Again(first) => return format.respond(&evidence::replayed(&first)),
            evidence::Seen::First(tell) => Some(tell),
        },
        None => None,
    };
    let keep = stored.filter(|_| options.store);
    if tell.is_none() && keep.is_none() {
        state.stats.work.fetch_add(1, Ordering::SeqCst);
        let _running = state.stats.running();
        return format.respond(&answer::work(n, &options, d, &text, &user).await);
    }
    // Work whose outcome is kept or told outlives its request: a client that
    // hangs up does not stop it, as a real provider's does not stop.
    let (stats, evidence) = (state.stats.clone(), state.evidence.clone());
    let task = tokio::spawn(async move {
        stats.work.fetch_add(1, Ordering::SeqCst);
        let running = stats.running();
        let outcome = answer::work(n, &options, d, &text, &user).await;
        drop(running);
        if let (Some(metadata), answer::Outcome::Answer(c)) = (keep, &outcome) {
            evidence.store(c.clone(), metadata, options.record_limit);
        }
        if let Some(tell) = tell {
            let _ = tell.send(Some(outcome.clone()));
        }
        outcome
    });
    match task.await {
        Ok(outcome) => format.respond(&outcome),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
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
        keep(&self.authorizations, "x-api-key");
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        if let Ok(mut traces) = self.traces.lock() {
            traces.push_back(TraceSeen {
                idempotency_key: text("idempotency-key"),
                traceparent: text("traceparent"),
                tracestate: text("tracestate"),
            });
            while traces.len() > limit {
                traces.pop_front();
            }
        }
        n
    }
}
