//! The HTTP gateway, `onejob-producer serve`: for upstream services that speak
//! HTTP rather than AMQP.
//!
//! `POST /v1/jobs` turns a request into exactly the intent an AMQP publisher would
//! send. The owner comes from the bearer token (never from the body) and the
//! idempotency key from the `Idempotency-Key` header; the body holds `operation`,
//! `input` and optionally `provider`, under the same strict rules as the message
//! ([`Intent::from_request`]). The gateway checks what it can before publishing
//! (so a bad request gets its `400` at once instead of a dead letter), then
//! publishes with a confirm and answers with the receipt the fleet sent back:
//!
//! | receipt | status | |
//! |---|---|---|
//! | `created` | 201 | `Location: /v1/jobs/{id}` |
//! | `duplicate` | 200 | the same job; `Idempotent-Replayed: true` |
//! | `conflict` | 422 | the key was used for a different request |
//! | `rejected` | 400 (413 when too large) | `error` says why |
//!
//! No receipt in time (504) or a broker that refused the publish (503) leaves the
//! request safe to retry with the same key: the database keeps one job per key.
//! The gateway keeps no state of its own beyond the requests it is answering, so
//! any number of them can run.
//!
//! `GET /v1/jobs/{id}` shows a job to its owner only (the owner is part of the
//! query): another owner's job is a `404`, as if it did not exist. The view is the
//! owner's, not the operator's: no provider error excerpts, request ids or usage.
//! `/openapi.json` describes all of it. `/healthz` and `/readyz` are served on the
//! public listener too; `/metrics` only on the probes listener (`--http`), as the
//! worker does, since request counts across owners are not a tenant's business.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use onejob::config::Config;
use onejob::domain::JobId;
use onejob::intent::{Intent, Outcome, Receipt, RejectReason};
use onejob::shutdown::Shutdown;
use onejob::store::Store;
use onejob::token::Token;
use serde::Serialize;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::owners::{Owners, Refusal};
use crate::{Producer, ProducerError, ProducerOptions};

/// The OpenAPI 3.1 description served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../openapi.json");

/// A gateway failure at start or while serving.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Postgres failed.
    #[error(transparent)]
    Store(#[from] onejob::store::StoreError),
    /// RabbitMQ failed.
    #[error(transparent)]
    Producer(#[from] ProducerError),
    /// The listener failed.
    #[error("http: {0}")]
    Io(#[from] std::io::Error),
    /// The RabbitMQ connection was lost while serving: exit, and let the
    /// orchestrator start a fresh gateway.
    #[error("the RabbitMQ connection was lost")]
    ConnectionLost,
}

/// An over-long body is read (and dropped) up to this multiple of the limit before
/// the `413`, so the client reads the answer instead of a reset connection.
const DRAIN_FACTOR: usize = 4;

/// Result alias for the gateway.
pub type Result<T, E = GatewayError> = std::result::Result<T, E>;

/// Settings of [`Gateway::connect`].
#[derive(Clone, Debug)]
pub struct GatewayOptions {
    /// How long a `POST /v1/jobs` waits for the fleet's receipt.
    pub receipt_timeout: Duration,
    /// Requests served at once; more get `503` with `Retry-After`.
    pub max_in_flight: usize,
    /// Requests one owner may have in flight at once; more get `429`.
    pub max_in_flight_per_owner: usize,
    /// Request bytes one owner may have in flight at once (as each request's
    /// `Content-Length` declares, or the message limit when it declares
    /// none); a request that would pass it gets `429`.
    pub max_bytes_in_flight_per_owner: usize,
    /// How long a client may take to send a request's line and headers
    /// (and, on a kept-alive connection, to start its next request).
    pub header_timeout: Duration,
    /// How long a client may take to send a request body.
    pub body_timeout: Duration,
    /// Connections held open at once; more wait to be accepted.
    pub max_connections: usize,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        Self {
            receipt_timeout: Duration::from_secs(10),
            max_in_flight: 256,
            max_in_flight_per_owner: 32,
            max_bytes_in_flight_per_owner: 32 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// What every request shares: configuration, the database (tokens and jobs) and
/// the producer connection.
#[derive(Debug)]
pub struct Gateway {
    config: Arc<Config>,
    store: Store,
    producer: Producer,
    in_flight: Semaphore,
    owners: Owners,
    options: GatewayOptions,
}

impl Gateway {
    /// Connects to Postgres (creating the database and applying migrations, as a
    /// worker does) and to RabbitMQ (declaring the intents topology with the
    /// fleet's delivery limit).
    pub async fn connect(
        config: Arc<Config>,
        database_url: &str,
        amqp_url: &str,
        options: GatewayOptions,
    ) -> Result<Gateway> {
        onejob::metrics::install();
        Store::ensure_database(database_url).await?;
        let store = Store::connect(
            database_url,
            8,
            onejob::runtime::routes(&config),
            Duration::from_secs(60),
        )
        .await?;
        store.migrate().await?;
        let producer = Producer::connect_with(
            amqp_url,
            ProducerOptions {
                receipt_timeout: options.receipt_timeout,
                delivery_limit: config.worker.delivery_limit,
            },
        )
        .await?;
        Ok(Gateway {
            config,
            store,
            producer,
            in_flight: Semaphore::new(options.max_in_flight.max(1)),
            owners: Owners::new(
                options.max_in_flight_per_owner,
                options.max_bytes_in_flight_per_owner,
            ),
            options,
        })
    }

    /// The public routes: `/v1/jobs`, `/v1/jobs/{id}`, `/openapi.json`,
    /// `/healthz` and `/readyz`. Every answer is counted by route and status.
    pub fn router(self: Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/v1/jobs", post(create_job))
            .route("/v1/jobs/{id}", get(show_job))
            .route(
                "/openapi.json",
                get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI) }),
            )
            .merge(probes())
            .route_layer(axum::middleware::from_fn(count_answers))
            .with_state(self)
    }

    /// The probes listener's routes: `/healthz`, `/readyz` and `/metrics`.
    pub fn probes_router(self: Arc<Self>) -> axum::Router {
        probes()
            .route("/metrics", get(|| async { onejob::metrics::render() }))
            .with_state(self)
    }

    /// Serves until `shutdown` (finishing the requests in flight), or until the
    /// RabbitMQ connection is lost, which is an error: the process should exit
    /// non-zero and be restarted.
    /// With `probes`, `/healthz`, `/readyz` and `/metrics` are served there too.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        probes: Option<tokio::net::TcpListener>,
        shutdown: Shutdown,
    ) -> Result<()> {
        let watched = self.clone();
        let stop = shutdown.clone();
        let supervisor = async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    () = stop.wait() => return Ok(()),
                    _ = tick.tick() => {}
                }
                if !watched.producer.is_connected() {
                    stop.trigger();
                    return Err(GatewayError::ConnectionLost);
                }
            }
        };
        let limits = onejob::http::ClientLimits {
            header_timeout: self.options.header_timeout,
            max_connections: self.options.max_connections,
        };
        let stop = shutdown.clone();
        let server = onejob::http::serve(listener, self.clone().router(), limits, async move {
            stop.wait().await
        });
        let stop = shutdown.clone();
        let probes_router = self.clone().probes_router();
        let probes = async move {
            match probes {
                Some(l) => {
                    onejob::http::serve(l, probes_router, limits, async move { stop.wait().await })
                        .await
                }
                None => Ok(()),
            }
        };
        let (served, probed, supervised) = tokio::join!(server, probes, supervisor);
        served?;
        probed?;
        supervised
    }

    /// Closes the RabbitMQ connection.
    pub async fn close(self) {
        self.producer.close().await;
    }
}

/// Counts every answer by route and status, for `/metrics`.
async fn count_answers(
    route: axum::extract::MatchedPath,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let route = route.as_str().to_owned();
    let response = next.run(request).await;
    onejob::metrics::gateway_answer(&route, response.status().as_u16());
    response
}

/// `/healthz` (the process is up) and `/readyz` (Postgres answers and the
/// RabbitMQ connection is up).
fn probes() -> axum::Router<Arc<Gateway>> {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
}

/// A JSON error that is not a receipt: `{"error": "code: detail"}`.
fn problem(status: StatusCode, error: String) -> Response {
    (status, axum::Json(json!({ "error": error }))).into_response()
}

fn unauthorized(detail: &str) -> Response {
    let mut response = problem(StatusCode::UNAUTHORIZED, format!("unauthorized: {detail}"));
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"onejob\""),
    );
    response
}

fn unavailable(status: StatusCode, error: String) -> Response {
    let mut response = problem(status, error);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// The owner the request's bearer token belongs to, or the response refusing it.
async fn owner(gateway: &Gateway, headers: &HeaderMap) -> Result<String, Response> {
    // The scheme is case-insensitive (RFC 9110 section 11.1).
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token)
        .ok_or_else(|| unauthorized("send `Authorization: Bearer <token>`"))?;
    let token = Token::parse(presented.trim())
        .ok_or_else(|| unauthorized("the token is unknown or revoked"))?;
    match gateway.store.token_owner(&token).await {
        Ok(Some(owner)) => Ok(owner),
        Ok(None) => Err(unauthorized("the token is unknown or revoked")),
        Err(e) => {
            tracing::warn!(error = %e, "cannot check a token");
            Err(unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable: the database cannot be reached; retry".into(),
            ))
        }
    }
}

fn receipt_response(status: StatusCode, receipt: &Receipt) -> Response {
    let mut response = (status, axum::Json(receipt)).into_response();
    if let Some(id) = receipt.job_id
        && let Ok(location) = HeaderValue::from_str(&format!("/v1/jobs/{id}"))
    {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

fn rejected(reason: &RejectReason) -> Response {
    let status = match reason {
        RejectReason::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    };
    receipt_response(status, &Receipt::rejected(reason))
}

fn overloaded() -> Response {
    unavailable(
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded: too many requests in flight; retry".into(),
    )
}

/// An owner holds as much as it may already: `429`, with why.
fn refused(owner: &str, refusal: Refusal, options: &GatewayOptions) -> Response {
    onejob::metrics::gateway_refused(owner, refusal.label());
    let why = match refusal {
        Refusal::Requests => format!(
            "too_many_requests: this owner has {} requests in flight already; retry when one is answered",
            options.max_in_flight_per_owner
        ),
        Refusal::Bytes => format!(
            "too_many_requests: this request would pass this owner's {} bytes in flight; retry when one is answered",
            options.max_bytes_in_flight_per_owner
        ),
    };
    unavailable(StatusCode::TOO_MANY_REQUESTS, why)
}

/// The body size a request declares (`Content-Length`), if it does.
fn declared_length(headers: &HeaderMap) -> Option<usize> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Reads a request body of at most `limit` bytes, within `timeout`.
async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Vec<u8>, Response> {
    use futures_util::StreamExt;
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut size = 0usize;
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|_| {
                problem(
                    StatusCode::BAD_REQUEST,
                    "bad_body: the request body could not be read".into(),
                )
            })?;
            size = size.saturating_add(chunk.len());
            if size <= limit {
                kept.extend_from_slice(&chunk);
            } else if size > limit.saturating_mul(DRAIN_FACTOR) {
                break;
            }
        }
        Ok(())
    };
    match tokio::time::timeout(timeout, read).await {
        Err(_) => Err(problem(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "request_timeout: the body did not arrive within {}",
                humantime::format_duration(timeout)
            ),
        )),
        Ok(Err(response)) => Err(response),
        Ok(Ok(())) if size > limit => Err(rejected(&RejectReason::TooLarge { size, limit })),
        Ok(Ok(())) => Ok(kept),
    }
}

async fn create_job(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let Ok(_permit) = gateway.in_flight.try_acquire() else {
        return overloaded();
    };
    let (parts, body) = request.into_parts();
    let owner = match owner(&gateway, &parts.headers).await {
        Ok(o) => o,
        Err(response) => return response,
    };
    let Some(key) = parts.headers.get("idempotency-key") else {
        return problem(
            StatusCode::BAD_REQUEST,
            "missing_idempotency_key: send an `Idempotency-Key` header, the same on every retry of one intention".into(),
        );
    };
    let Ok(key) = key.to_str() else {
        return rejected(&RejectReason::BadCharacters {
            field: "idempotency_key",
            allowed: "printable ASCII",
        });
    };
    let limit = gateway.config.worker.max_message_bytes;
    // What this owner holds is bounded, so that it cannot hold the gateway's
    // places from every other owner.
    let declared = declared_length(&parts.headers).unwrap_or(limit);
    let _held = match gateway
        .owners
        .take(&owner, declared.min(limit.saturating_add(1)))
    {
        Ok(held) => held,
        Err(refusal) => return refused(&owner, refusal, &gateway.options),
    };
    let body = match read_body(body, limit, gateway.options.body_timeout).await {
        Ok(b) => b,
        Err(response) => return response,
    };
    let intent = match Intent::from_request(&body, &owner, key, limit) {
        Ok(i) => i,
        Err(reason) => return rejected(&reason),
    };
    if let Err(reason) = gateway.config.admit(&intent) {
        return rejected(&reason);
    }
    // The message carries the owner and key as well: it must fit the limit that
    // intake applies, or it would only be rejected there.
    let message = serde_json::to_vec(&intent).unwrap_or_default();
    if message.len() > limit {
        return rejected(&RejectReason::TooLarge {
            size: message.len(),
            limit,
        });
    }
    match gateway.producer.submit_raw(&message).await {
        Ok(receipt) => {
            tracing::debug!(owner = %intent.owner_id, outcome = ?receipt.outcome, "intent answered");
            answer(receipt, &intent.idempotency_key)
        }
        Err(e @ ProducerError::ReceiptTimeout(_)) => {
            unavailable(StatusCode::GATEWAY_TIMEOUT, format!("receipt_timeout: {e}"))
        }
        Err(e @ ProducerError::ReplyChannelClosed) => {
            unavailable(StatusCode::SERVICE_UNAVAILABLE, format!("unavailable: {e}"))
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot publish an intent");
            unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("unavailable: the intent was not published ({e}); retry with the same key"),
            )
        }
    }
}

/// The HTTP answer for a receipt: 201 created, 200 for a duplicate (marked
/// replayed), 422 for a conflict, 413 or 400 for a rejection.
fn answer(receipt: Receipt, idempotency_key: &str) -> Response {
    match receipt.outcome {
        Outcome::Created => receipt_response(StatusCode::CREATED, &receipt),
        Outcome::Duplicate => {
            let mut response = receipt_response(StatusCode::OK, &receipt);
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            response
        }
        Outcome::Conflict => {
            // The receipt carries no error; over HTTP, say what happened.
            let explained = Receipt {
                error: Some(format!(
                    "conflict: Idempotency-Key {idempotency_key:?} was already used for a different request; that job is neither shown nor changed"
                )),
                ..receipt
            };
            receipt_response(StatusCode::UNPROCESSABLE_ENTITY, &explained)
        }
        // The fleet's configuration may differ from this gateway's.
        Outcome::Rejected
            if receipt
                .error
                .as_deref()
                .is_some_and(|e| e.starts_with("too_large")) =>
        {
            receipt_response(StatusCode::PAYLOAD_TOO_LARGE, &receipt)
        }
        Outcome::Rejected => receipt_response(StatusCode::BAD_REQUEST, &receipt),
    }
}

async fn show_job(
    State(gateway): State<Arc<Gateway>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Ok(_permit) = gateway.in_flight.try_acquire() else {
        return overloaded();
    };
    let owner = match owner(&gateway, &headers).await {
        Ok(o) => o,
        Err(response) => return response,
    };
    let not_found = || problem(StatusCode::NOT_FOUND, format!("not_found: no job {id}"));
    let Ok(job_id) = id.parse::<uuid::Uuid>() else {
        return not_found();
    };
    // Another owner's job is not found, so ids reveal nothing.
    match gateway.store.owned_job(JobId(job_id), &owner).await {
        Ok(Some(job)) => (StatusCode::OK, axum::Json(PublicJob::from(job))).into_response(),
        Ok(None) => not_found(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read a job");
            unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable: the database cannot be reached; retry".into(),
            )
        }
    }
}

async fn ready(State(gateway): State<Arc<Gateway>>) -> (StatusCode, String) {
    onejob::runtime::readiness(gateway.store.ping().await, gateway.producer.is_connected())
}

/// A job as its owner sees it through the gateway.
#[derive(Debug, Serialize)]
struct PublicJob {
    id: JobId,
    owner_id: String,
    idempotency_key: String,
    operation: String,
    input: serde_json::Value,
    provider: Option<String>,
    status: onejob::domain::JobStatus,
    version: i64,
    result: Option<serde_json::Value>,
    error: Option<PublicError>,
    created_at: chrono::DateTime<chrono::Utc>,
    updated_at: chrono::DateTime<chrono::Utc>,
    attempts: Vec<PublicAttempt>,
}

/// Why a job failed or was cancelled, as its owner sees it: a stable code and a
/// message written by onejob. The provider's own error text (status lines, body
/// excerpts) is for operators only (`onejob jobs show`).
#[derive(Debug, PartialEq, Serialize)]
struct PublicError {
    code: &'static str,
    message: &'static str,
}

impl PublicError {
    /// The owner's view of a stored error ([`onejob::domain::public_error`]).
    fn of(stored: &str) -> PublicError {
        let (code, message) = onejob::domain::public_error(stored);
        PublicError { code, message }
    }
}

/// An attempt as the job's owner sees it: when and where, and how it ended.
#[derive(Debug, Serialize)]
struct PublicAttempt {
    number: i32,
    provider: String,
    status: onejob::domain::AttemptStatus,
    created_at: chrono::DateTime<chrono::Utc>,
    started_at: Option<chrono::DateTime<chrono::Utc>>,
    finished_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl From<onejob::store::JobView> for PublicJob {
    fn from(job: onejob::store::JobView) -> Self {
        PublicJob {
            id: job.id,
            owner_id: job.owner_id,
            idempotency_key: job.idempotency_key,
            operation: job.operation,
            input: job.input,
            provider: job.provider,
            status: job.status,
            version: job.version,
            result: job.result,
            error: job.error.as_deref().map(PublicError::of),
            created_at: job.created_at,
            updated_at: job.updated_at,
            attempts: job
                .attempts
                .into_iter()
                .map(|a| PublicAttempt {
                    number: a.number,
                    provider: a.provider,
                    status: a.status,
                    created_at: a.created_at,
                    started_at: a.started_at,
                    finished_at: a.finished_at,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PublicError;

    #[test]
    fn stored_errors_become_stable_codes() {
        let e = PublicError::of(r#"provider_error: HTTP 401: {"error":"bad key sk-123"}"#);
        assert_eq!(e.code, "provider_error");
        assert!(!e.message.contains("401"));
        assert_eq!(
            PublicError::of(
                "no_qualified_provider: no provider …; last error: provider_error: HTTP 500"
            )
            .code,
            "no_qualified_provider"
        );
        assert_eq!(
            PublicError::of("dead_lettered: delivery_limit (see q)").code,
            "attempt_lost"
        );
        assert_eq!(
            PublicError::of("cancelled: by an operator").code,
            "cancelled"
        );
        assert_eq!(PublicError::of("something new").code, "failed");
    }
}
