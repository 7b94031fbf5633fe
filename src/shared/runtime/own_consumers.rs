//! The attempt consumers this process runs, for its intake to hand the
//! attempts it has just admitted to: a worker that runs both intake and a
//! provider's consumer claims and calls a job it admitted while one of that
//! consumer's call slots is free, instead of waiting for the attempt's
//! message to come back through the broker (two hops: its publish confirmed,
//! its delivery). The message is published all the same, and its delivery
//! finds the attempt taken.
//!
//! Every guarantee rests on the claim, as for a delivery: one guarded
//! statement moves the attempt `queued → started`, so the claim made here and
//! the one its delivery makes have one winner. A worker killed at any instant
//! leaves the attempt to its message (claimed here or not, the message is in
//! the outbox, and is published by the relay if this worker did not) or, once
//! started, to the vanished sweep, as any started attempt.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use crate::domain::AttemptId;
use crate::edges::store::OutboxMessage;
use crate::trace::TraceContext;

/// What a consumer does with an attempt offered to it: true when it took it
/// (a call slot was free, and it is claiming it).
pub type Take = Arc<dyn Fn(AttemptId, Option<TraceContext>) -> bool + Send + Sync>;

/// The consumers of this process, by the routing key of their provider's
/// attempt messages.
#[derive(Clone, Default)]
pub struct OwnConsumers {
    takers: Arc<RwLock<HashMap<String, Take>>>,
}

impl OwnConsumers {
    /// Registers the consumer of the attempt messages routed by
    /// `routing_key`, until the returned guard is dropped.
    pub fn register(&self, routing_key: &str, take: Take) -> Registered {
        if let Ok(mut takers) = self.takers.write() {
            takers.insert(routing_key.to_owned(), take);
        }
        Registered {
            consumers: self.clone(),
            routing_key: routing_key.to_owned(),
        }
    }

    /// Offers each attempt message of `messages` to this process's consumer
    /// of its provider, if it runs one; returns how many were taken.
    pub fn offer(&self, messages: &[OutboxMessage]) -> usize {
        let Ok(takers) = self.takers.read() else {
            return 0;
        };
        if takers.is_empty() {
            return 0;
        }
        messages
            .iter()
            .filter(|m| m.exchange == crate::broker::EXCHANGE)
            .filter_map(|m| {
                let take = takers.get(&m.routing_key)?;
                let attempt = uuid::Uuid::parse_str(&m.message_id).ok()?;
                Some(take(AttemptId(attempt), m.trace()))
            })
            .filter(|taken| *taken)
            .count()
    }
}

impl std::fmt::Debug for OwnConsumers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<String> = self
            .takers
            .read()
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default();
        f.debug_struct("OwnConsumers")
            .field("routing_keys", &keys)
            .finish()
    }
}

/// A consumer's registration: dropped, its consumer takes nothing more.
pub struct Registered {
    consumers: OwnConsumers,
    routing_key: String,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Ok(mut takers) = self.consumers.takers.write() {
            takers.remove(&self.routing_key);
        }
    }
}
