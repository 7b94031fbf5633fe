//! Declaring the topology every program makes at start, and looking at a queue
//! as the broker sees it now.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ExchangeKind};

use super::topology::{describe_work_args, quorum_args, work_queue_args, work_queues};
use super::{BrokerError, DLX, EVENTS, EXCHANGE, Result, dead_letter_queue, short};

/// Whether an AMQP error is the broker's 406 PRECONDITION_FAILED (a queue
/// redeclared with other arguments, a delete refused because the queue is not
/// empty or in use).
pub(super) fn precondition_failed(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(p) if p.get_id() == 406)
}

/// Declares the whole topology: exchanges, the intents queue, one attempts queue per
/// provider, and a dead-letter queue for each work queue.
pub async fn declare_topology(
    conn: &Connection,
    providers: &[String],
    delivery_limit: u32,
) -> Result<()> {
    let ch = super::open_channel(conn).await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    for (name, kind) in [
        (EXCHANGE, ExchangeKind::Direct),
        (DLX, ExchangeKind::Direct),
        (EVENTS, ExchangeKind::Topic),
    ] {
        ch.exchange_declare(name.into(), kind, durable, FieldTable::default())
            .await?;
    }
    let work = work_queues(providers);
    let queue_opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    for (queue, key) in &work {
        if let Err(e) = ch
            .queue_declare(
                short(queue)?,
                queue_opts,
                work_queue_args(queue, delivery_limit),
            )
            .await
        {
            return Err(if precondition_failed(&e) {
                BrokerError::OutdatedQueue {
                    queue: queue.clone(),
                    expected: describe_work_args(delivery_limit),
                }
            } else {
                e.into()
            });
        }
        bind_work_queue(&ch, queue, key).await?;
        let dlq = dead_letter_queue(queue);
        ch.queue_declare(short(&dlq)?, queue_opts, quorum_args())
            .await?;
        ch.queue_bind(
            short(&dlq)?,
            DLX.into(),
            short(queue)?,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    ch.close(200, "topology declared".into()).await?;
    Ok(())
}

/// A queue as the broker sees it now (a passive declare: nothing is created or
/// taken; a missing queue closes `ch`).
pub(super) async fn inspect(ch: &Channel, queue: &str) -> Result<lapin::Queue> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    Ok(ch
        .queue_declare(short(queue)?, options, FieldTable::default())
        .await?)
}

/// The number of ready messages in `queue`, looked at on a channel of its own.
pub async fn depth(conn: &Connection, queue: &str) -> Result<u32> {
    let ch = super::open_channel(conn).await?;
    let q = inspect(&ch, queue).await?;
    let _ = ch.close(200, "counted".into()).await;
    Ok(q.message_count())
}

/// Binds a work queue to the work exchange with its routing key.
pub(super) async fn bind_work_queue(ch: &Channel, queue: &str, key: &str) -> Result<()> {
    ch.queue_bind(
        short(queue)?,
        EXCHANGE.into(),
        short(key)?,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}
