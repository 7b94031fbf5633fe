//! `[worker]`: the worker-wide settings, each with a production default.

use std::time::Duration;

use serde::Deserialize;

use super::Result;
use super::checks::{at_least, duration, invalid, prefetch};
use crate::intent::DEFAULT_MAX_BODY_BYTES;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWorker {
    delivery_limit: Option<u32>,
    max_message_bytes: Option<usize>,
    intake_prefetch: Option<u32>,
    attempt_prefetch: Option<u32>,
    batch_size: Option<usize>,
    flush_interval: Option<String>,
    pool_size: Option<u32>,
    retry_backoff: Option<String>,
    retry_backoff_max: Option<String>,
    relay_interval: Option<String>,
    outbox_lease: Option<String>,
    vanished_grace: Option<String>,
    pub(super) shutdown_grace: Option<String>,
    stuck_after: Option<String>,
    max_republish: Option<u32>,
    dead_letter_scan: Option<String>,
    outbox_retention: Option<String>,
    reply_queues: Option<Vec<String>>,
}

/// Worker-wide settings (`[worker]`), each with a production default.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// `x-delivery-limit` of every work queue.
    pub delivery_limit: u32,
    /// The largest intent body accepted.
    pub max_message_bytes: usize,
    /// Unacked intents one intake consumer holds at most.
    pub intake_prefetch: u16,
    /// Unacked attempt messages one attempt consumer holds at most: those being
    /// called, those waiting for their settlement to commit, and the next ones.
    pub attempt_prefetch: u16,
    /// The most intents admitted, attempts claimed (never more than the
    /// provider's `concurrency`) or attempts settled by one statement.
    pub batch_size: usize,
    /// How long a finished attempt waits for others to share its commit.
    pub flush_interval: Duration,
    /// Postgres connections in each of a worker process's two pools (the
    /// per-job statements', and the rest's).
    pub pool_size: u32,
    /// Backoff before the attempt that follows a definite failure; it doubles per
    /// attempt, with jitter, up to `retry_backoff_max`.
    pub retry_backoff: Duration,
    /// The cap on that backoff.
    pub retry_backoff_max: Duration,
    /// How often the relay looks for due outbox rows.
    pub relay_interval: Duration,
    /// How long a publisher owns an outbox row before the relay may take it over.
    pub outbox_lease: Duration,
    /// How long past its deadline a `started` attempt may stay silent before the
    /// reconciler declares its worker vanished and the attempt `unknown`.
    pub vanished_grace: Duration,
    /// How long a stopping worker waits for in-flight work.
    pub shutdown_grace: Duration,
    /// How long a published attempt may stay `queued` before the reconciler
    /// decides its message is gone and republishes it.
    pub stuck_after: Duration,
    /// Republishes of one attempt before it is failed (`attempt_lost`).
    pub max_republish: u32,
    /// How often the reconciler reads the attempts' dead-letter queues to mark
    /// the attempts whose messages died there.
    pub dead_letter_scan: Duration,
    /// How long a published outbox row is kept (a redelivered intent finds the
    /// first attempt's row within it) before the reconciler deletes it.
    pub outbox_retention: Duration,
    /// Named queues an intent's `reply_to` may name for its receipt, besides
    /// direct reply-to (`amq.rabbitmq.reply-to`), which is always allowed.
    pub reply_queues: Vec<String>,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            delivery_limit: 5,
            max_message_bytes: DEFAULT_MAX_BODY_BYTES,
            intake_prefetch: 256,
            attempt_prefetch: 512,
            batch_size: 128,
            flush_interval: Duration::from_millis(5),
            pool_size: 8,
            retry_backoff: Duration::from_secs(1),
            retry_backoff_max: Duration::from_secs(60),
            relay_interval: Duration::from_millis(500),
            outbox_lease: Duration::from_secs(30),
            vanished_grace: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
            stuck_after: Duration::from_secs(600),
            max_republish: 3,
            dead_letter_scan: Duration::from_secs(30),
            outbox_retention: Duration::from_secs(3600),
            reply_queues: Vec::new(),
        }
    }
}

/// The largest `worker.batch_size`: one statement's arrays stay small.
pub const MAX_BATCH_SIZE: usize = 1000;
/// The longest `worker.flush_interval`.
pub const MAX_FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// `worker.reply_queues`: queue names a publisher's own service reads, never
/// one of onejob's (`onejob.…`) nor the broker's (`amq.…`): a receipt there
/// would be a message forged into another consumer's queue.
fn reply_queues(origin: &str, names: &[String]) -> Result<Vec<String>> {
    for name in names {
        if name.is_empty() || name.len() > 255 {
            return Err(invalid(
                origin,
                "worker.reply_queues",
                format!("{name:?}: a queue name is 1 to 255 bytes"),
            ));
        }
        if name.starts_with("onejob") || name.starts_with("amq.") {
            return Err(invalid(
                origin,
                "worker.reply_queues",
                format!(
                    "{name:?} is onejob's or the broker's own queue; receipts may not go there"
                ),
            ));
        }
    }
    Ok(names.to_vec())
}

impl WorkerSettings {
    /// Whether a receipt may be published to `reply_to` (contract section
    /// 4): direct reply-to, a queue the broker named (`amq.gen-…`, what a
    /// publisher written after RabbitMQ's RPC tutorial declares for itself),
    /// or a queue `reply_queues` names. Never one of onejob's queues nor any
    /// other `amq.` name.
    pub fn reply_allowed(&self, reply_to: &str) -> bool {
        reply_to == "amq.rabbitmq.reply-to"
            || reply_to.starts_with("amq.rabbitmq.reply-to.")
            || is_server_named(reply_to)
            || self.reply_queues.iter().any(|q| q == reply_to)
    }
}

/// Whether `queue` is a name the broker gives a queue declared with an empty
/// name: `amq.gen-` and a non-empty tail of the characters RabbitMQ uses
/// (URL-safe base64). No client may declare an `amq.` name itself, so such a
/// queue belongs to a publisher, never to onejob or another service.
fn is_server_named(queue: &str) -> bool {
    queue.len() <= 255
        && queue.strip_prefix("amq.gen-").is_some_and(|tail| {
            !tail.is_empty()
                && tail
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

impl WorkerSettings {
    /// `[worker]`: each setting checked, defaults for the rest.
    pub(super) fn parse(origin: &str, w: &RawWorker) -> Result<WorkerSettings> {
        let defaults = WorkerSettings::default();
        let d = |key: &str, text: &Option<String>, default: Duration| {
            duration(origin, &format!("worker.{key}"), text, default)
        };
        let worker = WorkerSettings {
            delivery_limit: at_least(
                origin,
                "worker.delivery_limit",
                w.delivery_limit,
                1,
                defaults.delivery_limit,
            )?,
            max_message_bytes: at_least(
                origin,
                "worker.max_message_bytes",
                w.max_message_bytes,
                256,
                defaults.max_message_bytes,
            )?,
            intake_prefetch: prefetch(
                origin,
                "worker.intake_prefetch",
                w.intake_prefetch,
                defaults.intake_prefetch,
            )?,
            attempt_prefetch: prefetch(
                origin,
                "worker.attempt_prefetch",
                w.attempt_prefetch,
                defaults.attempt_prefetch,
            )?,
            batch_size: at_least(
                origin,
                "worker.batch_size",
                w.batch_size,
                1,
                defaults.batch_size,
            )?,
            flush_interval: d("flush_interval", &w.flush_interval, defaults.flush_interval)?,
            pool_size: at_least(
                origin,
                "worker.pool_size",
                w.pool_size,
                2,
                defaults.pool_size,
            )?,
            retry_backoff: d("retry_backoff", &w.retry_backoff, defaults.retry_backoff)?,
            retry_backoff_max: d(
                "retry_backoff_max",
                &w.retry_backoff_max,
                defaults.retry_backoff_max,
            )?,
            relay_interval: d("relay_interval", &w.relay_interval, defaults.relay_interval)?,
            outbox_lease: d("outbox_lease", &w.outbox_lease, defaults.outbox_lease)?,
            vanished_grace: d("vanished_grace", &w.vanished_grace, defaults.vanished_grace)?,
            shutdown_grace: d("shutdown_grace", &w.shutdown_grace, defaults.shutdown_grace)?,
            stuck_after: d("stuck_after", &w.stuck_after, defaults.stuck_after)?,
            max_republish: w.max_republish.unwrap_or(defaults.max_republish),
            dead_letter_scan: d(
                "dead_letter_scan",
                &w.dead_letter_scan,
                defaults.dead_letter_scan,
            )?,
            outbox_retention: d(
                "outbox_retention",
                &w.outbox_retention,
                defaults.outbox_retention,
            )?,
            reply_queues: reply_queues(origin, w.reply_queues.as_deref().unwrap_or_default())?,
        };
        worker.check_bounds(origin)?;
        Ok(worker)
    }

    /// The bounds that span settings, or that a setting's own parse does not
    /// hold.
    fn check_bounds(&self, origin: &str) -> Result<()> {
        if self.batch_size > MAX_BATCH_SIZE {
            return Err(invalid(
                origin,
                "worker.batch_size",
                format!("must be at most {MAX_BATCH_SIZE}"),
            ));
        }
        if self.flush_interval > MAX_FLUSH_INTERVAL {
            return Err(invalid(
                origin,
                "worker.flush_interval",
                "must be at most 1s: every finished attempt waits up to this long",
            ));
        }
        if self.retry_backoff_max < self.retry_backoff {
            return Err(invalid(
                origin,
                "worker.retry_backoff_max",
                "must not be shorter than worker.retry_backoff",
            ));
        }
        Ok(())
    }
}
