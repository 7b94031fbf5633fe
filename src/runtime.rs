//! What every role shares: the [`Context`] (configuration, store, broker
//! connection and publisher), consuming with bounded prefetch, acking and
//! requeueing, retries that wait out a dependency outage, connection supervision
//! and the health endpoints.
//!
//! Every role follows one rule: ack a delivery only after what it caused is
//! committed and, for publishes, confirmed. A crash at any instant then means a
//! redelivery, which the database turns into a no-op.

use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use futures_util::future::join_all;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, message::Delivery};

use crate::broker::{self, BrokerError, Publisher};
use crate::config::Config;
use crate::domain::{AttemptId, JobId};
use crate::intent::{Intent, RejectReason};
use crate::shutdown::Shutdown;
use crate::store::{NewJob, OutboxMessage, Routes, Store, StoreError};

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
    DeadLetters(#[from] crate::dlq::DlqError),
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
}

/// The outbox routes for a configuration.
pub fn routes(config: &Config) -> Routes {
    Routes {
        work_exchange: broker::EXCHANGE.to_owned(),
        events_exchange: broker::EVENTS.to_owned(),
        lease: config.worker.outbox_lease,
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
        crate::metrics::install();
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
        crate::metrics::dead_lettered(queue);
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
    let (_, provider) = config.admit(&intent)?;
    Ok(NewJob {
        job_id: JobId::new(),
        attempt_id: AttemptId::new(),
        fingerprint: intent.fingerprint(),
        intent,
        provider,
    })
}

/// How many fresh copies of an intent onejob has made ([`Context::hand_on_intent`]).
pub const HANDED_ON_HEADER: &str = "x-onejob-handed-on";

/// What a copy of a message keeps: the contract's list, and nothing else.
/// Another user's `user_id` would make the broker refuse the copy, an
/// `expiration` would drop it from its queue.
fn copied_properties(original: &BasicProperties, headers: FieldTable) -> BasicProperties {
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
    store.mark_published(&published).await?;
    failed.map_or(Ok(()), |e| Err(e.into()))
}

/// Publishes outbox rows, their confirms awaited together; the ids of those
/// confirmed, and the first failure.
async fn publish_rows(
    publisher: &Publisher,
    messages: &[OutboxMessage],
) -> (Vec<i64>, Option<BrokerError>) {
    let results = join_all(messages.iter().map(|m| async move {
        let body = serde_json::to_vec(&m.body).unwrap_or_default();
        let props = broker::json_properties().with_message_id(broker::short(&m.message_id)?);
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
    crate::metrics::published(published.len());
    (published, first_error)
}

/// How long published outbox ids gather before one statement marks them all.
const MARK_EVERY: Duration = Duration::from_millis(50);

/// Marks published outbox rows in batches, at most one statement every
/// [`MARK_EVERY`]: nobody waits for a mark (it only keeps the relay from
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
            if let Err(e) = store.mark_published(&ids).await {
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

/// How long a worker's RabbitMQ connection may stay down, recovering, before the
/// worker gives up and exits (non-zero) to be restarted.
const RECONNECT_WATCHDOG: Duration = Duration::from_secs(120);

/// Acks a delivery, treating a closed channel as an error (lapin returns
/// `Ok(false)` then, and the broker will redeliver).
pub async fn ack(delivery: &Delivery) -> Result<()> {
    if !delivery.acker.ack(BasicAckOptions::default()).await? {
        tracing::warn!(
            delivery_tag = delivery.delivery_tag,
            "ack not sent: channel closed; the broker will redeliver"
        );
    }
    Ok(())
}

/// Returns a delivery to its queue for another try.
pub async fn requeue(delivery: &Delivery) {
    let options = BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    };
    match delivery.acker.nack(options).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!("nack not sent: channel closed; the broker will redeliver"),
        Err(e) => tracing::warn!(error = %e, "nack failed; the broker will redeliver"),
    }
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
                BrokerError::ConfirmTimeout { .. } | BrokerError::NoConnection(_),
            ) => true,
            _ => false,
        }
    }
}

/// Retries `f` with backoff. While a dependency is unreachable it waits for as
/// long as the outage lasts: the delivery being worked on stays with this worker,
/// unacked, so an outage never counts against its delivery limit (contract
/// section 2), and `/readyz` says the worker is not ready meanwhile. When
/// `shutdown` is given it stops waiting at once, so the caller can hand the
/// delivery back without delay. Other failures are retried about fifteen times
/// (a minute or so); data Postgres refuses is not retried at all.
pub async fn with_retries<T, F, Fut>(shutdown: &Shutdown, what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    const OTHER_FAILURES: u32 = 15;
    let mut delays = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build();
    let mut failures = 0;
    loop {
        let error = match f().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let unavailable = error.is_unavailable();
        if !unavailable {
            failures += 1;
        }
        if shutdown.is_triggered()
            || failures > OTHER_FAILURES
            || matches!(&error, WorkerError::Store(s) if s.is_data_error())
        {
            return Err(error);
        }
        let delay = delays.next().unwrap_or(Duration::from_secs(5));
        if unavailable {
            tracing::warn!(error = %error, retry_in = ?delay, "{what}: a dependency is unreachable; holding the work and waiting");
        } else {
            tracing::warn!(error = %error, retry_in = ?delay, "{what} failed; retrying");
        }
        tokio::select! {
            () = shutdown.wait() => return Err(error),
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// Consumes `queue` with at most `prefetch` unacked deliveries, running `handle`
/// on each in its own task. On shutdown it stops taking deliveries, waits up to
/// the grace period for those in flight, and leaves the rest to redelivery.
pub async fn consume<H, Fut>(
    ctx: &Context,
    queue: &str,
    prefetch: u16,
    shutdown: &Shutdown,
    handle: H,
) -> Result<()>
where
    H: Fn(Delivery) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let batching = Batching {
        max_batch: 1,
        max_in_flight: usize::from(prefetch.max(1)),
    };
    consume_batches(
        ctx,
        queue,
        prefetch,
        batching,
        shutdown,
        Arrival::Batch,
        |mut batch| {
            // A batch of one: `max_batch` is 1.
            handle(batch.remove(0))
        },
    )
    .await
}

/// A group commit: work handed in one item at a time is done by `flush` in
/// batches. A flush starts at once when no other is running; while one is,
/// items gather, and the next flush starts when the first of them has waited
/// `interval`, when `size` of them are waiting, or when the running flush is
/// done (at most [`GroupCommit::IN_FLIGHT`] run at once). So a lone item never
/// waits for company, and under load each flush carries every item that arrived
/// during the one before.
pub(crate) struct GroupCommit<T, R> {
    items: tokio::sync::mpsc::UnboundedSender<Submitted<T, R>>,
}

/// An item handed in: when, and where its answer goes.
type Submitted<T, R> = (T, std::time::Instant, tokio::sync::oneshot::Sender<R>);

/// The stages a [`GroupCommit`] times (see [`crate::metrics::STAGE_SECONDS`]):
/// an item's wait for its flush, and the flush.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stages {
    pub wait: &'static str,
    pub flush: &'static str,
}

/// What a [`GroupCommit`] does with an item whose submitter stopped waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Abandoned {
    /// Leave it out of the flush.
    Skip,
    /// Flush it all the same.
    Flush,
}

impl<T, R> Clone for GroupCommit<T, R> {
    fn clone(&self) -> Self {
        Self {
            items: self.items.clone(),
        }
    }
}

impl<T: Send + 'static, R: Send + 'static> GroupCommit<T, R> {
    /// Flushes running at once.
    pub(crate) const IN_FLIGHT: usize = 4;

    /// Starts the task that flushes. `flush` answers each item of its batch, in
    /// order. The task ends once every handle is dropped and what they handed
    /// in is flushed.
    pub(crate) fn start<F, Fut>(
        stages: Stages,
        size: usize,
        interval: Duration,
        abandoned: Abandoned,
        flush: F,
    ) -> (tokio::task::JoinHandle<()>, Self)
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Vec<R>> + Send + 'static,
    {
        let (items, pending) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(group_commit(
            stages,
            size.max(1),
            interval,
            abandoned,
            pending,
            flush,
        ));
        (task, Self { items })
    }

    /// Hands in `item` and waits for its answer; `None` when the flush that took
    /// it did not finish (the task stopped).
    pub(crate) async fn submit(&self, item: T) -> Option<R> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        self.items
            .send((item, std::time::Instant::now(), answer))
            .ok()?;
        answered.await.ok()
    }
}

async fn group_commit<T, R, F, Fut>(
    stages: Stages,
    size: usize,
    interval: Duration,
    abandoned: Abandoned,
    mut pending: tokio::sync::mpsc::UnboundedReceiver<Submitted<T, R>>,
    flush: F,
) where
    T: Send + 'static,
    R: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = Vec<R>> + Send + 'static,
{
    use tokio::time::Instant;
    let in_flight_max = GroupCommit::<T, R>::IN_FLIGHT;
    let mut flushes = tokio::task::JoinSet::new();
    let mut batch = Vec::new();
    let mut due: Option<Instant> = None;
    let mut open = true;
    loop {
        let overdue = due.is_some_and(|d| d <= Instant::now());
        if !batch.is_empty()
            && flushes.len() < in_flight_max
            && (flushes.is_empty() || batch.len() >= size || overdue)
        {
            let mut take: Vec<Submitted<T, R>> = std::mem::take(&mut batch);
            if abandoned == Abandoned::Skip {
                take.retain(|(_, _, answer)| !answer.is_closed());
                if take.is_empty() {
                    due = None;
                    continue;
                }
            }
            let mut items = Vec::with_capacity(take.len());
            let mut answers = Vec::with_capacity(take.len());
            for (item, submitted, answer) in take {
                crate::metrics::stage(stages.wait, submitted.elapsed());
                items.push(item);
                answers.push(answer);
            }
            let done = crate::metrics::timed(stages.flush, flush(items));
            flushes.spawn(async move {
                for (answer, result) in answers.into_iter().zip(done.await) {
                    let _ = answer.send(result);
                }
            });
            due = None;
            continue;
        }
        if !open && batch.is_empty() {
            break;
        }
        tokio::select! {
            next = pending.recv(), if open && batch.len() < size => match next {
                Some(first) => {
                    due.get_or_insert_with(|| Instant::now() + interval);
                    batch.push(first);
                    while batch.len() < size {
                        match pending.try_recv() {
                            Ok(next) => batch.push(next),
                            Err(_) => break,
                        }
                    }
                }
                None => open = false,
            },
            Some(_) = flushes.join_next(), if !flushes.is_empty() => {}
            () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)),
                if due.is_some() && !overdue && flushes.len() < in_flight_max => {}
        }
    }
    while flushes.join_next().await.is_some() {}
}

/// How [`consume_batches`] groups deliveries.
#[derive(Clone, Copy, Debug)]
pub struct Batching {
    /// The most deliveries in one batch.
    pub max_batch: usize,
    /// The most batches being handled at once. While that many are, deliveries
    /// wait in the consumer, so the next batch takes all that arrived meanwhile:
    /// batches grow with the load, and a lone delivery never waits for company.
    pub max_in_flight: usize,
}

/// Consumes `queue` like [`consume`], but hands `handle` every delivery that is
/// ready at once (up to `max_batch`), so that one statement can settle them all.
pub async fn consume_batches<H, Fut, A>(
    ctx: &Context,
    queue: &str,
    prefetch: u16,
    batching: Batching,
    shutdown: &Shutdown,
    arrive: A,
    handle: H,
) -> Result<()>
where
    A: Fn(Delivery) -> Arrival,
    H: Fn(Vec<Delivery>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    use futures_util::{FutureExt, StreamExt};

    let (channel, mut consumer) = open_consumer(ctx, queue, prefetch).await?;
    let stopped = |next: Option<std::result::Result<Delivery, lapin::Error>>| match next {
        Some(Err(e)) => Err(WorkerError::Amqp(e)),
        _ => Err(WorkerError::RoleStopped(
            queue.to_owned(),
            "the broker cancelled the consumer".into(),
        )),
    };
    let mut in_flight = tokio::task::JoinSet::new();
    let mut aside = tokio::task::JoinSet::new();
    // Deliveries that arrived while every batch slot was taken: at most
    // `prefetch`, since the broker sends no more unacked ones than that.
    let mut ready: std::collections::VecDeque<Delivery> = std::collections::VecDeque::new();
    let max_in_flight = batching.max_in_flight.max(1);
    let outcome = loop {
        while in_flight.len() < max_in_flight && !ready.is_empty() {
            let take = ready.len().min(batching.max_batch.max(1));
            in_flight.spawn(handle(ready.drain(..take).collect()));
        }
        tokio::select! {
            () = shutdown.wait() => break Ok(()),
            next = consumer.next() => {
                let mut next = Some(next);
                let mut ended = None;
                // Every delivery that is there now, each met on arrival.
                while let Some(got) = next.take() {
                    match got {
                        Some(Ok(delivery)) => match arrive(delivery) {
                            Arrival::Batch(delivery) => ready.push_back(delivery),
                            Arrival::Aside(work) => {
                                aside.spawn(work);
                            }
                        },
                        other => {
                            ended = Some(stopped(other));
                            break;
                        }
                    }
                    next = consumer.next().now_or_never();
                }
                if let Some(end) = ended {
                    break end;
                }
            },
            Some(joined) = in_flight.join_next(), if !in_flight.is_empty() => {
                // A handler that panicked left its deliveries unsettled: stop, so
                // that the channel closes and the broker hands them out again.
                if let Err(e) = joined
                    && e.is_panic()
                {
                    break Err(WorkerError::RoleStopped(
                        queue.to_owned(),
                        "a delivery handler panicked; its deliveries go back to the queue".into(),
                    ));
                }
            }
            Some(_) = aside.join_next(), if !aside.is_empty() => {}
        }
    };
    in_flight.spawn(async move { while aside.join_next().await.is_some() {} });
    stop_consumer(ctx, queue, &channel, &consumer, in_flight).await;
    outcome
}

/// What a consumer does with a delivery the moment it arrives, before it waits
/// for a batch slot. It lives for a moment on the stack: its size is no cost
/// worth an allocation per delivery.
#[allow(clippy::large_enum_variant)]
pub enum Arrival {
    /// Into the next batch.
    Batch(Delivery),
    /// Settled by this work, beside the batches.
    Aside(futures_util::future::BoxFuture<'static, ()>),
}

/// A channel with `prefetch` and a consumer on `queue`.
async fn open_consumer(
    ctx: &Context,
    queue: &str,
    prefetch: u16,
) -> Result<(lapin::Channel, lapin::Consumer)> {
    use lapin::options::{BasicConsumeOptions, BasicQosOptions};
    let channel = ctx.connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            broker::short(queue)?,
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((channel, consumer))
}

/// Cancels the consumer, lets the handlers in flight finish within
/// `shutdown_grace` (what is unfinished then goes back to the queue when the
/// channel closes), and closes the channel.
async fn stop_consumer(
    ctx: &Context,
    queue: &str,
    channel: &lapin::Channel,
    consumer: &lapin::Consumer,
    mut in_flight: tokio::task::JoinSet<()>,
) {
    use lapin::options::BasicCancelOptions;
    let _ = channel
        .basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await;
    let grace = ctx.config.worker.shutdown_grace;
    let drained = tokio::time::timeout(grace, async {
        while in_flight.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            queue,
            remaining = in_flight.len(),
            "shutdown grace over; unfinished deliveries go back to the queue"
        );
        in_flight.shutdown().await;
    }
    let _ = channel.close(200, "worker stopping".into()).await;
}

/// Watches the AMQP connection and the publishing channel. Automatic recovery
/// handles short outages; once it gives up (the connection is closed or errored
/// for good), this returns an error, [`crate::fleet::run`] stops every role, and the worker
/// exits non-zero so that its orchestrator restarts it. A publishing channel the
/// broker closed is replaced with a fresh one.
pub async fn supervise_connection(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut down_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = shutdown.wait() => return Ok(()),
            _ = tick.tick() => {}
        }
        let status = ctx.connection.status();
        if status.errored() || status.closed() {
            return Err(WorkerError::RoleStopped(
                "amqp connection".into(),
                "RabbitMQ connection lost and automatic recovery gave up".into(),
            ));
        }
        // Recovery retries refused connections for about a minute, but a node
        // that takes the TCP connection and never answers the AMQP handshake (a
        // frozen node, a half-open path) would hold it forever: past the
        // watchdog, the worker exits for its orchestrator to restart it.
        if status.connected() {
            down_since = None;
        } else {
            let since = *down_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() > RECONNECT_WATCHDOG {
                return Err(WorkerError::RoleStopped(
                    "amqp connection".into(),
                    format!(
                        "RabbitMQ connection not back after {RECONNECT_WATCHDOG:?} of recovery"
                    ),
                ));
            }
        }
        match ctx.publisher.heal(&ctx.connection).await {
            Ok(true) => {
                tracing::warn!("the broker had closed the publishing channel; opened a new one")
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "cannot reopen the publishing channel yet"),
        }
    }
}

/// The `/readyz` answer of a process that needs both services: `200` when both
/// are up, else `503`, with one line per service.
pub fn readiness(postgres: bool, rabbitmq: bool) -> (axum::http::StatusCode, String) {
    let state = |up: bool| if up { "ok" } else { "down" };
    let body = format!(
        "postgres: {}\nrabbitmq: {}\n",
        state(postgres),
        state(rabbitmq)
    );
    if postgres && rabbitmq {
        (axum::http::StatusCode::OK, body)
    } else {
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

/// `/healthz` (the process is up), `/readyz` (Postgres answers and the AMQP
/// connection is connected) and `/metrics` (Prometheus text).
pub fn health_router(ctx: Context) -> axum::Router {
    use axum::http::StatusCode;
    use axum::routing::get;

    async fn ready(
        axum::extract::State(ctx): axum::extract::State<Context>,
    ) -> (StatusCode, String) {
        readiness(
            ctx.store.ping().await,
            ctx.connection.status().connected() && ctx.publisher.is_open(),
        )
    }

    // Read by a timer, never by a scrape.
    let gauges = crate::gauges::Gauges::refreshed(ctx.store.clone());
    let metrics = move || {
        let gauges = gauges.clone();
        async move {
            let g = gauges.text().unwrap_or_else(|| {
                "# the gauges have not been read from the database yet\n".to_owned()
            });
            (StatusCode::OK, g + &crate::metrics::render())
        }
    };

    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(ctx)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn unreachable() -> Result<()> {
        Err(WorkerError::Store(StoreError::Db(
            sqlx::Error::PoolTimedOut,
        )))
    }

    /// Item 4 of issue 8: an outage longer than any retry window (here ten
    /// minutes, on tokio's paused clock) never makes `with_retries` give the work
    /// back; shutdown does, at once.
    #[tokio::test(start_paused = true)]
    async fn an_outage_is_waited_out_until_shutdown() {
        let shutdown = Shutdown::new();
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let task = {
            let (shutdown, calls) = (shutdown.clone(), calls.clone());
            tokio::spawn(async move {
                with_retries(&shutdown, "test", || {
                    calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async { unreachable() }
                })
                .await
            })
        };
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!task.is_finished(), "gave up during the outage");
        assert!(
            calls.load(std::sync::atomic::Ordering::SeqCst) > 60,
            "kept trying"
        );
        shutdown.trigger();
        let result = tokio::time::timeout(Duration::from_millis(10), task)
            .await
            .expect("returns at once on shutdown")
            .unwrap();
        assert!(result.is_err());
    }

    /// Other failures are still bounded: a poison message does not spin forever.
    #[tokio::test(start_paused = true)]
    async fn other_failures_are_retried_a_bounded_number_of_times() {
        let calls = std::sync::atomic::AtomicU32::new(0);
        let result: Result<()> = with_retries(&Shutdown::new(), "test", || {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Err(WorkerError::RoleStopped("x".into(), "y".into())) }
        })
        .await;
        assert!(result.is_err());
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 16);
    }
}
