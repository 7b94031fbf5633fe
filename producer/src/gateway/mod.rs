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
//! | `rejected` with `budget_exceeded` | 429 | `Retry-After`: when the job's reservation may fit in its owner's budget again; a new identity that would not fit is answered before anything is published |
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
//!
//! | file | holds |
//! |---|---|
//! | `serve` | the routes, the probes, and serving until shutdown |
//! | `bearer` | the owner a request's bearer token belongs to |
//! | `create` | `POST /v1/jobs`: the request read, checked and published |
//! | `show` | `GET /v1/jobs/{id}`: a job as its owner sees it |
//! | `answers` | the HTTP answers: receipts, refusals and errors |
//!
//! [`Intent::from_request`]: onejob::intent::Intent::from_request

use std::sync::Arc;
use std::time::Duration;

use onejob::edges::store::Store;
use onejob::settings::config::Config;
use tokio::sync::Semaphore;

use crate::owners::Owners;
use crate::{Producer, ProducerError, ProducerOptions};

mod answers;
mod bearer;
mod create;
mod serve;
mod show;

/// The OpenAPI 3.1 description served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../openapi.json");

/// A gateway failure at start or while serving.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Postgres failed.
    #[error(transparent)]
    Store(#[from] onejob::edges::store::StoreError),
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
        onejob::edges::metrics::install();
        Store::ensure_database(database_url).await?;
        let store = Store::connect(
            database_url,
            8,
            onejob::shared::runtime::routes(&config),
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

    /// Closes the RabbitMQ connection.
    pub async fn close(self) {
        self.producer.close().await;
    }
}
