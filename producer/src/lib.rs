//! The client library upstream Rust services embed to publish job intents.
//!
//! [`Producer::submit`] publishes an intent with a publisher confirm and
//! `mandatory` set (an intent no queue would take is an error, not a silent drop),
//! then awaits its receipt through RabbitMQ's direct reply-to.
//! [`Producer::publish_only`] stops after the confirm. Retrying a submit with the
//! same intent is always safe: the worker answers `duplicate` with the same job.
//!
//! ```no_run
//! # async fn demo() -> Result<(), onejob_producer::ProducerError> {
//! use onejob_producer::{Intent, Producer};
//! let producer = Producer::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?;
//! let intent = Intent {
//!     owner_id: "acct_42".into(),
//!     idempotency_key: "c0a8012e-5d1f-4b55-9a7b-1f2d3c4b5a69".into(),
//!     operation: "summarize".into(),
//!     input: serde_json::json!({"text": "..."}).as_object().cloned().unwrap_or_default(),
//!     provider: None,
//! };
//! let receipt = producer.submit(&intent).await?;
//! println!("{:?} {:?}", receipt.outcome, receipt.job_id);
//! # Ok(()) }
//! ```

#[cfg(feature = "gateway")]
pub mod gateway;
#[cfg(feature = "gateway")]
mod owners;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use onejob_core::broker::{self, BrokerError, Publisher};
pub use onejob_core::intent::{Intent, Outcome, Receipt};
pub use onejob_core::trace::TraceContext;
use tokio::sync::oneshot;

/// The pseudo-queue of RabbitMQ's direct reply-to.
const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// A producer failure.
#[derive(Debug, thiserror::Error)]
pub enum ProducerError {
    /// The AMQP client failed.
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    /// Publishing failed (nacked, unroutable).
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// No receipt came in time. The intent was confirmed by the broker and may
    /// still be processed: submit it again with the same key to learn its job.
    #[error(
        "no receipt within {0:?}; the intent was confirmed and may still be processed: resubmit it with the same key to learn its outcome"
    )]
    ReceiptTimeout(Duration),
    /// The reply consumer stopped (the connection was lost). The intent was
    /// confirmed by the broker: submit it again with the same key.
    #[error(
        "the connection closed before the receipt arrived; the intent was confirmed and may still be processed: resubmit it with the same key to learn its outcome"
    )]
    ReplyChannelClosed,
}

/// Result alias for the producer.
pub type Result<T, E = ProducerError> = std::result::Result<T, E>;

/// Settings for [`Producer::connect_with`].
#[derive(Clone, Debug)]
pub struct ProducerOptions {
    /// How long [`Producer::submit`] waits for a receipt.
    pub receipt_timeout: Duration,
    /// The `x-delivery-limit` the worker fleet declares (the topology declarations
    /// must match).
    pub delivery_limit: u32,
}

impl Default for ProducerOptions {
    fn default() -> Self {
        Self {
            receipt_timeout: Duration::from_secs(30),
            delivery_limit: 5,
        }
    }
}

type Pending = Arc<Mutex<HashMap<String, oneshot::Sender<Receipt>>>>;

/// A connection that publishes intents and collects their receipts.
#[derive(Debug)]
pub struct Producer {
    connection: Connection,
    publisher: Publisher,
    pending: Pending,
    options: ProducerOptions,
    reader: tokio::task::JoinHandle<()>,
}

impl Producer {
    /// Connects with default options.
    pub async fn connect(amqp_url: &str) -> Result<Producer> {
        Self::connect_with(amqp_url, ProducerOptions::default()).await
    }

    /// Connects, declares the intents topology, and starts the receipt reader.
    ///
    /// `amqp_url` is one URL or the comma-separated URLs of a cluster's nodes;
    /// the producer connects to the first node that answers. A lost connection
    /// is not recovered: every publish in flight on it fails (none is silently
    /// lost), [`Producer::is_connected`] turns false, and a new `Producer`
    /// connects to the first node that answers then.
    pub async fn connect_with(amqp_url: &str, options: ProducerOptions) -> Result<Producer> {
        let connection = broker::connect(amqp_url, broker::Recovery::None).await?;
        broker::declare_topology(&connection, &[], options.delivery_limit).await?;
        let channel = broker::open_channel(&connection).await?;
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await?;
        let pending: Pending = Arc::default();
        let reader = tokio::spawn(read_receipts(channel.clone(), pending.clone()).await?);
        Ok(Producer {
            connection,
            publisher: Publisher::from_channel(channel),
            pending,
            options,
            reader,
        })
    }

    /// Publishes an intent and waits for its receipt.
    pub async fn submit(&self, intent: &Intent) -> Result<Receipt> {
        let body = serde_json::to_vec(intent).unwrap_or_default();
        self.submit_raw(&body).await
    }

    /// Publishes an intent in the caller's trace and waits for its receipt: the
    /// message carries `trace` as its `traceparent` and `tracestate` headers,
    /// and onejob's spans for the job continue that trace. (Without one, the
    /// worker starts a trace for the job.)
    pub async fn submit_in_trace(&self, intent: &Intent, trace: &TraceContext) -> Result<Receipt> {
        let body = serde_json::to_vec(intent).unwrap_or_default();
        self.submit_raw_in_trace(&body, Some(trace)).await
    }

    /// Publishes any body as an intent and waits for its receipt: for tools and
    /// tests that need to send what [`Intent`] cannot express.
    pub async fn submit_raw(&self, body: &[u8]) -> Result<Receipt> {
        self.submit_raw_in_trace(body, None).await
    }

    /// [`Producer::submit_raw`], in the caller's trace when there is one.
    pub async fn submit_raw_in_trace(
        &self,
        body: &[u8],
        trace: Option<&TraceContext>,
    ) -> Result<Receipt> {
        let correlation_id = uuid::Uuid::now_v7().to_string();
        let (tx, rx) = oneshot::channel();
        if let Ok(mut p) = self.pending.lock() {
            p.insert(correlation_id.clone(), tx);
        }
        // However this call ends (an error, a timeout, or its caller dropping it,
        // as an HTTP server does when its client goes away), its waiter goes.
        let _waiter = Waiter {
            pending: &self.pending,
            correlation_id: &correlation_id,
        };
        let props = in_trace(identified(), trace)
            .with_reply_to(DIRECT_REPLY_TO.into())
            .with_correlation_id(correlation_id.as_str().into());
        self.publisher
            .publish(broker::EXCHANGE, broker::INTENTS_KEY, body, props, true)
            .await?;
        match tokio::time::timeout(self.options.receipt_timeout, rx).await {
            Ok(Ok(receipt)) => Ok(receipt),
            Ok(Err(_)) => Err(ProducerError::ReplyChannelClosed),
            Err(_) => Err(ProducerError::ReceiptTimeout(self.options.receipt_timeout)),
        }
    }

    /// How many submits are waiting for their receipt.
    pub fn waiting(&self) -> usize {
        self.pending.lock().map_or(0, |p| p.len())
    }

    /// Publishes an intent and returns once the broker confirmed it; no receipt.
    pub async fn publish_only(&self, intent: &Intent) -> Result<()> {
        self.publish_only_traced(intent, None).await
    }

    /// [`Producer::publish_only`], in the caller's trace (as
    /// [`Producer::submit_in_trace`] carries it).
    pub async fn publish_only_in_trace(&self, intent: &Intent, trace: &TraceContext) -> Result<()> {
        self.publish_only_traced(intent, Some(trace)).await
    }

    async fn publish_only_traced(
        &self,
        intent: &Intent,
        trace: Option<&TraceContext>,
    ) -> Result<()> {
        let body = serde_json::to_vec(intent).unwrap_or_default();
        self.publisher
            .publish(
                broker::EXCHANGE,
                broker::INTENTS_KEY,
                &body,
                in_trace(identified(), trace),
                true,
            )
            .await?;
        Ok(())
    }

    /// Whether the connection is up: a lost connection is not recovered, so a
    /// long-lived owner (the gateway) should exit and be restarted.
    pub fn is_connected(&self) -> bool {
        self.connection.status().connected() && !self.reader.is_finished()
    }

    /// Closes the connection.
    pub async fn close(self) {
        self.reader.abort();
        let _ = self.connection.close(200, "producer closed".into()).await;
    }
}

/// The properties of an intent message: persistent JSON with a fresh
/// `message_id` (so an operator can pick it out of a dead-letter queue) and the
/// time it was sent.
fn identified() -> lapin::BasicProperties {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    broker::json_properties()
        .with_message_id(uuid::Uuid::now_v7().to_string().as_str().into())
        .with_timestamp(now)
}

/// The properties with the trace's `traceparent` and `tracestate` headers,
/// when there is a trace.
fn in_trace(
    properties: lapin::BasicProperties,
    trace: Option<&TraceContext>,
) -> lapin::BasicProperties {
    match trace {
        Some(trace) => {
            let mut headers = FieldTable::default();
            trace.insert_into(&mut headers);
            properties.with_headers(headers)
        }
        None => properties,
    }
}

/// Removes a submit's entry from the waiters when the submit ends.
struct Waiter<'a> {
    pending: &'a Pending,
    correlation_id: &'a str,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if let Ok(mut p) = self.pending.lock() {
            p.remove(self.correlation_id);
        }
    }
}

/// Starts consuming direct reply-to on `channel` (the same channel publishes, as
/// RabbitMQ requires) and returns the task that hands receipts to their waiters.
async fn read_receipts(
    channel: Channel,
    pending: Pending,
) -> Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let mut consumer = channel
        .basic_consume(
            DIRECT_REPLY_TO.into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(async move {
        while let Some(Ok(delivery)) = consumer.next().await {
            let Some(id) = delivery.properties.correlation_id() else {
                continue;
            };
            let waiter = pending.lock().ok().and_then(|mut p| p.remove(id.as_str()));
            match (waiter, serde_json::from_slice::<Receipt>(&delivery.data)) {
                (Some(tx), Ok(receipt)) => {
                    let _ = tx.send(receipt);
                }
                (None, _) => {
                    tracing::debug!(correlation_id = %id, "receipt for nobody (timed out?)")
                }
                (Some(_), Err(e)) => tracing::warn!(error = %e, "unreadable receipt"),
            }
        }
        // Dropping the senders wakes every waiter with ReplyChannelClosed.
        if let Ok(mut p) = pending.lock() {
            p.clear();
        }
    })
}
