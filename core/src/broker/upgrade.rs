//! `onejob queues upgrade`: work queues declared with other arguments (by an
//! older version) brought to this version's, never deleting one that holds
//! messages.

use lapin::Connection;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

use super::declare::{bind_work_queue, inspect, precondition_failed};
use super::topology::{work_queue_args, work_queues};
use super::{EXCHANGE, Result, declare_topology, short};

/// What `onejob queues upgrade` did with one work queue.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum QueueUpgrade {
    /// It already had this version's arguments (or did not exist, and now does).
    Current,
    /// It was empty and unused: deleted and declared again with this version's
    /// arguments.
    Redeclared,
    /// It holds messages or has consumers: left as it is.
    Refused {
        /// Ready messages in it.
        messages: u32,
        /// Consumers on it.
        consumers: u32,
    },
}

/// Brings every work queue to this version's arguments, then declares the rest of
/// the topology. A queue declared otherwise is deleted and declared again only if
/// it is empty and has no consumer, checked once more after it has been unbound
/// from the work exchange, so a queue that holds messages is never deleted.
pub async fn upgrade_queues(
    conn: &Connection,
    providers: &[String],
    delivery_limit: u32,
) -> Result<Vec<(String, QueueUpgrade)>> {
    let mut out = Vec::new();
    for (queue, key) in work_queues(providers) {
        let upgrade = upgrade_queue(conn, &queue, &key, delivery_limit).await?;
        out.push((queue, upgrade));
    }
    if out
        .iter()
        .all(|(_, u)| !matches!(u, QueueUpgrade::Refused { .. }))
    {
        declare_topology(conn, providers, delivery_limit).await?;
    }
    Ok(out)
}

/// One work queue of [`upgrade_queues`].
async fn upgrade_queue(
    conn: &Connection,
    queue: &str,
    key: &str,
    delivery_limit: u32,
) -> Result<QueueUpgrade> {
    use lapin::options::QueueDeleteOptions;
    let queue_opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let args = || work_queue_args(queue, delivery_limit);
    let refused = |q: &lapin::Queue| QueueUpgrade::Refused {
        messages: q.message_count(),
        consumers: q.consumer_count(),
    };
    // Each step on a channel of its own: a 406 closes the channel it hit.
    let ch = super::open_channel(conn).await?;
    match ch.queue_declare(short(queue)?, queue_opts, args()).await {
        Ok(_) => {
            let _ = ch.close(200, "checked".into()).await;
            return Ok(QueueUpgrade::Current);
        }
        Err(e) if precondition_failed(&e) => {}
        Err(e) => return Err(e.into()),
    }
    let ch = super::open_channel(conn).await?;
    let existing = inspect(&ch, queue).await?;
    if existing.message_count() > 0 || existing.consumer_count() > 0 {
        let _ = ch.close(200, "checked".into()).await;
        return Ok(refused(&existing));
    }
    // Unbind it first, so that nothing new is routed to it, then look again:
    // quorum queues do not support the `if-empty` delete, so emptiness is
    // checked here, after the last way in is closed. A mandatory publish meanwhile
    // comes back unroutable to its publisher, which retries; nothing is lost.
    ch.queue_unbind(
        short(queue)?,
        EXCHANGE.into(),
        short(key)?,
        FieldTable::default(),
    )
    .await?;
    let again = inspect(&ch, queue).await?;
    if again.message_count() > 0 || again.consumer_count() > 0 {
        bind_work_queue(&ch, queue, key).await?;
        let _ = ch.close(200, "checked".into()).await;
        return Ok(refused(&again));
    }
    ch.queue_delete(short(queue)?, QueueDeleteOptions::default())
        .await?;
    ch.queue_declare(short(queue)?, queue_opts, args()).await?;
    // Bound again at once: other queues refused must not leave this one
    // unroutable until the next declaration.
    bind_work_queue(&ch, queue, key).await?;
    let _ = ch.close(200, "redeclared".into()).await;
    Ok(QueueUpgrade::Redeclared)
}
