//! What every role shares: the [`Context`] (configuration, store, broker
//! connection and publisher), consuming with bounded prefetch, acking and
//! requeueing, retries that wait out a dependency outage, connection supervision
//! and the health endpoints.
//!
//! Every role follows one rule: ack a delivery only after what it caused is
//! committed and, for publishes, confirmed. A crash at any instant then means a
//! redelivery, which the database turns into a no-op.
//!
//! The rooms: `publish` (confirms, the outbox, marks), `delivery` (ack,
//! requeue, retries), `consume` (prefetch, batches), `group_commit`, and
//! `health` (supervision, probes). This file holds the context itself.

mod consume;
mod delivery;
mod group_commit;
mod health;
pub mod own_consumers;
pub mod pass_runs;
mod publish;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, message::Delivery};
use publish::{copied_properties, publish_rows};

use crate::broker::{self, BrokerError, Publisher};
use crate::domain::{AttemptId, JobId};
use crate::edges::store::{NewJob, OutboxMessage, Routes, Store, StoreError};
use crate::intent::{Intent, RejectReason};
use crate::settings::config::Config;

pub use consume::{Arrival, Batching, consume, consume_batches};
pub use delivery::{ack, requeue, with_retries};
pub(crate) use group_commit::{Abandoned, GroupCommit, Stages, Unheard};
pub use health::{health_router, readiness, supervise_connection};
pub use publish::{HANDED_ON_HEADER, Marks, operator_connection, publish_now, publish_outbox};

/// A worker failure.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Postgres.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// RabbitMQ.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The AMQP client.
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    /// Reading a dead-letter queue.
    #[error(transparent)]
    DeadLetters(#[from] crate::shared::dlq::DlqError),
    /// A role names a provider that is not configured.
    #[error("--provider {0:?} is not a configured provider")]
    UnknownProvider(String),
    /// A finished attempt was not settled (its flush failed, or Postgres
    /// refused it): its delivery goes back to the queue.
    #[error("attempt not settled: {0}")]
    Unsettled(String),
    /// A role stopped on its own.
    #[error("role {0} stopped unexpectedly: {1}")]
    RoleStopped(String, String),
}

/// Result alias for the worker.
pub type Result<T, E = WorkerError> = std::result::Result<T, E>;

/// Everything the roles share.
#[derive(Clone, Debug)]
pub struct Context {
    /// The configuration.
    pub config: Arc<Config>,
    /// Postgres.
    pub store: Store,
    /// The AMQP connection.
    pub connection: Arc<Connection>,
    /// A confirm-mode channel for everything the roles publish.
    pub publisher: Publisher,
    /// Marks published outbox rows in batches.
    pub marks: Marks,
    /// This process's attempt consumers, for its intake to hand the attempts
    /// it admits to.
    pub own_consumers: own_consumers::OwnConsumers,
    /// The runs of this process's reconciler passes.
    pub pass_runs: pass_runs::PassRuns,
}

/// The outbox routes for a configuration.
pub fn routes(config: &Config) -> Routes {
    Routes {
        work_exchange: broker::EXCHANGE.to_owned(),
        events_exchange: broker::EVENTS.to_owned(),
        lease: config.worker.outbox_lease,
        owners: config.owners,
        shares: config
            .providers
            .values()
            .map(|p| (p.name.clone(), p.share()))
            .collect(),
    }
}

impl Context {
    /// Connects everything, applies migrations and declares the topology.
    pub async fn connect(
        config: Arc<Config>,
        database_url: &str,
        amqp_url: &str,
    ) -> Result<Context> {
        // Wait for Postgres as Store::connect does: a worker may start first.
        (|| Store::ensure_database(database_url))
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(2))
                    .with_total_delay(Some(Duration::from_secs(60)))
                    .without_max_times(),
            )
            .when(|e| matches!(e, StoreError::Db(sqlx::Error::Io(_))))
            .notify(|e, d| {
                tracing::warn!(
                    url = %broker::redact_url(database_url),
                    error = %e.describe(database_url),
                    retry_in = ?d,
                    "database not reachable yet"
                )
            })
            .await?;
        crate::edges::metrics::install();
        let store = Store::connect(
            database_url,
            config.worker.pool_size,
            routes(&config),
            Duration::from_secs(60),
        )
        .await?;
        store.migrate().await?;
        let connection = broker::connect(amqp_url, broker::Recovery::Auto).await.map_err(|e| {
            tracing::error!(url = %broker::redact_url(amqp_url), error = %e, "cannot connect to RabbitMQ");
            e
        })?;
        broker::declare_topology(
            &connection,
            &config.provider_names(),
            config.worker.delivery_limit,
        )
        .await?;
        let publisher = Publisher::open(&connection).await?;
        Ok(Context {
            config,
            marks: Marks::start(store.clone()),
            store,
            connection: Arc::new(connection),
            publisher,
            own_consumers: own_consumers::OwnConsumers::default(),
            pass_runs: pass_runs::PassRuns::default(),
        })
    }

    /// Publishes outbox rows with confirms; they are marked published with the
    /// next batch of marks ([`Marks`]).
    pub async fn publish_outbox(&self, messages: &[OutboxMessage]) -> Result<()> {
        let (published, failed) = publish_rows(&self.publisher, messages).await;
        self.marks.published(published);
        failed.map_or(Ok(()), |e| Err(e.into()))
    }

    /// Copies a delivery to its queue's dead-letter queue with a reason, and waits
    /// for the confirm. The caller acks the original afterwards, never before. The
    /// copy keeps the body, `message_id`, `correlation_id`, `reply_to`, `timestamp`
    /// and headers (contract section 2).
    pub async fn publish_dead_letter(
        &self,
        queue: &str,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<()> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(
            broker::ERROR_HEADER.into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        headers.insert(
            "x-onejob-original-exchange".into(),
            AMQPValue::LongString(LongString::from(delivery.exchange.as_str())),
        );
        headers.insert(
            "x-onejob-original-routing-key".into(),
            AMQPValue::LongString(LongString::from(delivery.routing_key.as_str())),
        );
        headers.insert(
            broker::DEAD_LETTERED_AT_HEADER.into(),
            AMQPValue::Timestamp(chrono::Utc::now().timestamp().max(0).unsigned_abs()),
        );
        let props = copied_properties(&delivery.properties, headers);
        self.publisher
            .publish(broker::DLX, queue, &delivery.data, props, true)
            .await?;
        crate::edges::metrics::dead_lettered(queue);
        Ok(())
    }

    /// Publishes a fresh copy of an intent delivery to the intents queue, and
    /// waits for its confirm: the same body and properties, its delivery count
    /// left behind, `x-onejob-handed-on` counting the copies made so far.
    pub async fn hand_on_intent(&self, delivery: &Delivery, handed_on: u32) -> Result<()> {
        let mut headers = FieldTable::default();
        if let Some(original) = delivery.properties.headers() {
            for (k, v) in original.inner() {
                if k.as_str() != "x-delivery-count" && k.as_str() != HANDED_ON_HEADER {
                    headers.insert(k.clone(), v.clone());
                }
            }
        }
        headers.insert(HANDED_ON_HEADER.into(), AMQPValue::LongUInt(handed_on));
        let props = copied_properties(&delivery.properties, headers);
        self.publisher
            .publish(
                broker::EXCHANGE,
                broker::INTENTS_KEY,
                &delivery.data,
                props,
                true,
            )
            .await?;
        Ok(())
    }
}

/// Validates an intent body against the contract and the configuration, and
/// makes the job it would become.
pub fn new_job(config: &Config, body: &[u8]) -> std::result::Result<NewJob, RejectReason> {
    let intent = Intent::parse(body, config.worker.max_message_bytes)?;
    let (operation, provider, rendered) = config.admit(&intent)?;
    let reserve = reservation(config, operation, &provider, &rendered);
    Ok(NewJob {
        job_id: JobId::new(),
        attempt_id: AttemptId::new(),
        fingerprint: intent.fingerprint(),
        intent,
        provider,
        trace: None,
        reserve,
    })
}

/// What one attempt of a job reserves of its owner's budget: its prompt's
/// tokens, counted with the provider's model's encoding (an estimate where
/// tiktoken does not know the model), plus its operation's `max_tokens`.
pub fn reservation(
    config: &Config,
    operation: &crate::settings::config::Operation,
    provider: &str,
    rendered: &crate::settings::config::Rendered,
) -> i64 {
    let model = config
        .providers
        .get(provider)
        .map_or("", |p| p.model.as_str());
    let (prompt, _) = crate::shared::qualify::count_tokens(model, rendered);
    i64::try_from(prompt).unwrap_or(i64::MAX / 2) + i64::from(operation.max_tokens)
}

impl WorkerError {
    /// A dependency (Postgres or RabbitMQ) cannot be reached: nothing is wrong
    /// with the work itself.
    pub fn is_unavailable(&self) -> bool {
        let amqp = |e: &lapin::Error| {
            matches!(
                e.kind(),
                lapin::ErrorKind::IOError(_)
                    | lapin::ErrorKind::InvalidConnectionState(_)
                    | lapin::ErrorKind::InvalidChannelState(..)
                    | lapin::ErrorKind::MissingHeartbeatError
            )
        };
        match self {
            WorkerError::Store(e) => e.is_unavailable(),
            WorkerError::Amqp(e) | WorkerError::Broker(BrokerError::Amqp(e)) => amqp(e),
            WorkerError::Broker(
                BrokerError::ConfirmTimeout { .. }
                | BrokerError::NoConnection(_)
                | BrokerError::ChannelOpenTimeout(_),
            ) => true,
            _ => false,
        }
    }
}
