//! Consuming with bounded prefetch: one delivery at a time, or in batches
//! (a batch is handled once it is full or its first delivery has waited long
//! enough); consumers are opened and stopped cleanly.

use lapin::message::Delivery;
use lapin::types::FieldTable;

use super::{Context, Result, WorkerError};
use crate::broker::{self};
use crate::edges::shutdown::Shutdown;

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
    let channel = broker::open_channel(&ctx.connection).await?;
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
