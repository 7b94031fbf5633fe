//! Publishing with confirms: outbox rows (marked published in batches, off
//! the hot path), dead letters and handed-on intents keep their properties,
//! and the operator tools' one-shot publish.

use std::time::Duration;

use futures_util::future::join_all;
use lapin::BasicProperties;
use lapin::types::FieldTable;

use super::Result;
use crate::broker::{self, BrokerError, Publisher};
use crate::edges::store::{OutboxMessage, Store};
use crate::settings::config::Config;

/// How many fresh copies of an intent onejob has made ([`Context::hand_on_intent`](super::Context::hand_on_intent)).
pub const HANDED_ON_HEADER: &str = "x-onejob-handed-on";

/// What a copy of a message keeps: the contract's list, and nothing else.
/// Another user's `user_id` would make the broker refuse the copy, an
/// `expiration` would drop it from its queue.
pub(super) fn copied_properties(
    original: &BasicProperties,
    headers: FieldTable,
) -> BasicProperties {
    let mut props = broker::json_properties().with_headers(headers);
    if let Some(v) = original.message_id() {
        props = props.with_message_id(v.clone());
    }
    if let Some(v) = original.correlation_id() {
        props = props.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        props = props.with_reply_to(v.clone());
    }
    if let Some(v) = original.timestamp() {
        props = props.with_timestamp(*v);
    }
    props
}

/// Publishes outbox rows with confirms, then marks them published. A row whose
/// publish failed stays for the relay once its lease runs out.
pub async fn publish_outbox(
    publisher: &Publisher,
    store: &Store,
    messages: &[OutboxMessage],
) -> Result<()> {
    let (published, failed) = publish_rows(publisher, messages).await;
    store.outbox().mark_published(&published).await?;
    failed.map_or(Ok(()), |e| Err(e.into()))
}

/// Publishes outbox rows, their confirms awaited together; the ids of those
/// confirmed, and the first failure.
pub(super) async fn publish_rows(
    publisher: &Publisher,
    messages: &[OutboxMessage],
) -> (Vec<i64>, Option<BrokerError>) {
    let results = join_all(messages.iter().map(|m| async move {
        let body = serde_json::to_vec(&m.body).unwrap_or_default();
        let mut props = broker::json_properties().with_message_id(broker::short(&m.message_id)?);
        // The job's trace context, so its consumers continue the job's trace.
        if let Some(trace) = m.trace() {
            let mut headers = FieldTable::default();
            trace.insert_into(&mut headers);
            props = props.with_headers(headers);
        }
        // Attempt messages must reach a queue; events may have no subscriber yet.
        let mandatory = m.exchange == broker::EXCHANGE;
        publisher
            .publish(&m.exchange, &m.routing_key, &body, props, mandatory)
            .await
            .map(|()| m.id)
    }))
    .await;
    let mut published = Vec::with_capacity(results.len());
    let mut first_error = None;
    for r in results {
        match r {
            Ok(id) => published.push(id),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    crate::edges::metrics::published(published.len());
    (published, first_error)
}

/// How long published outbox ids gather before one statement marks them all.
const MARK_EVERY: Duration = Duration::from_millis(50);

/// Marks published outbox rows in batches, at most one statement every
/// `MARK_EVERY`: nobody waits for a mark (it only keeps the relay from
/// publishing the row again once its lease is over, 30 s by default), so a
/// busy worker need not pay a commit per publish. A mark that fails, or that a
/// crash loses, costs a second publish of the row, which its consumers already
/// take as the duplicate it is.
#[derive(Clone, Debug)]
pub struct Marks {
    queue: tokio::sync::mpsc::UnboundedSender<Mark>,
}

#[derive(Debug)]
enum Mark {
    Published(Vec<i64>),
    /// Mark what has gathered now, then answer.
    Flush(tokio::sync::oneshot::Sender<()>),
}

impl Marks {
    /// Starts the marking task; it ends when every handle is gone.
    pub fn start(store: Store) -> Marks {
        let (queue, pending) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(mark(store, pending));
        Marks { queue }
    }

    /// Hands in the ids of rows the broker confirmed.
    pub fn published(&self, ids: Vec<i64>) {
        if !ids.is_empty() {
            let _ = self.queue.send(Mark::Published(ids));
        }
    }

    /// Marks everything handed in so far, and waits for it.
    pub async fn flush(&self) {
        let (done, flushed) = tokio::sync::oneshot::channel();
        if self.queue.send(Mark::Flush(done)).is_ok() {
            let _ = flushed.await;
        }
    }
}

async fn mark(store: Store, mut pending: tokio::sync::mpsc::UnboundedReceiver<Mark>) {
    let write = |ids: Vec<i64>| {
        let store = store.clone();
        async move {
            if let Err(e) = store.outbox().mark_published(&ids).await {
                tracing::warn!(error = %e, rows = ids.len(), "outbox rows not marked published; the relay will publish them again");
            }
        }
    };
    let mut ids = Vec::new();
    let mut due = None;
    loop {
        let next = match due {
            Some(at) => tokio::select! {
                next = pending.recv() => next,
                () = tokio::time::sleep_until(at) => {
                    write(std::mem::take(&mut ids)).await;
                    due = None;
                    continue;
                }
            },
            None => pending.recv().await,
        };
        match next {
            Some(Mark::Published(more)) => {
                ids.extend(more);
                due.get_or_insert_with(|| tokio::time::Instant::now() + MARK_EVERY);
            }
            Some(Mark::Flush(done)) => {
                write(std::mem::take(&mut ids)).await;
                due = None;
                let _ = done.send(());
            }
            None => break,
        }
    }
    write(ids).await;
}

/// A broker connection for an operator's action (the CLI, the console): the
/// topology declared, no recovery; an unreachable broker is an error that
/// names it.
pub async fn operator_connection(
    amqp_url: &str,
    config: &Config,
) -> std::result::Result<lapin::Connection, String> {
    let conn = broker::connect(amqp_url, broker::Recovery::None)
        .await
        .map_err(|e| {
            format!(
                "cannot reach RabbitMQ at {}: {e}",
                broker::redact_url(amqp_url)
            )
        })?;
    broker::declare_topology(
        &conn,
        &config.provider_names(),
        config.worker.delivery_limit,
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(conn)
}

/// Publishes what an operator's action wrote to the outbox, at once, on a
/// connection of its own. On failure the rows stay for the reconciler's relay.
pub async fn publish_now(
    amqp_url: &str,
    config: &Config,
    store: &Store,
    messages: &[OutboxMessage],
) -> std::result::Result<(), String> {
    if messages.is_empty() {
        return Ok(());
    }
    let conn = operator_connection(amqp_url, config).await?;
    let publisher = Publisher::open(&conn).await.map_err(|e| e.to_string())?;
    let result = publish_outbox(&publisher, store, messages)
        .await
        .map_err(|e| e.to_string());
    let _ = conn.close(200, "done".into()).await;
    result
}
