//! Dead-lettered valid intents: an intent the broker dead-lettered for its
//! delivery limit although it is valid becomes a job all the same; the
//! letter stays for an operator.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::edges::store::{Admission, NewJob};
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};
use crate::trace::TraceContext;

use super::pass::Pass;

/// Letters one run reads at most.
const LETTERS: usize = 256;

/// The dead-lettered intents' scan, every `worker.dead_letter_scan`.
pub struct DeadIntents;

impl Pass for DeadIntents {
    fn name(&self) -> &'static str {
        "dead_intents"
    }

    fn every(&self, config: &Config) -> Duration {
        config.worker.dead_letter_scan
    }

    /// Intents the broker dead-lettered for their delivery limit although
    /// they are valid (workers died holding them more often than the limit
    /// allows: RabbitMQ counts a delivery held by a dead consumer as
    /// returned) become jobs all the same: each is admitted as intake would
    /// have, and its first attempt published. A valid intent always ends as
    /// a job. The letter stays in `onejob.intents.dlq`, as every dead letter
    /// does, for an operator to look at; its identity's job answers a replay
    /// as a `duplicate`. Browsing returns every dead letter to its queue.
    /// Returns the jobs created.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let queue = crate::broker::dead_letter_queue(crate::broker::INTENTS_QUEUE);
        let mut valid: Vec<NewJob> = Vec::new();
        crate::shared::dlq::visit(&ctx.connection, &queue, LETTERS, |letter, delivery| {
            if letter.reason == "delivery_limit"
                && let Ok(mut new) = crate::shared::runtime::new_job(&ctx.config, &delivery.data)
            {
                // The publisher's trace continues here as it would have at intake.
                let parent = TraceContext::from_headers(delivery.properties.headers().as_ref());
                new.trace = Some(TraceContext::child_or_root(parent.as_ref()));
                valid.push(new);
            }
        })
        .await?;
        if valid.is_empty() {
            return Ok(0);
        }
        let admitted = ctx.store.admission().admit(&valid).await?;
        let mut publish = Vec::new();
        let mut created = 0;
        for (new, admission) in valid.iter().zip(admitted) {
            if let Admission::Created {
                job_id,
                publish: message,
            } = admission
            {
                created += 1;
                tracing::warn!(%job_id, owner_id = %new.intent.owner_id, "a valid intent the broker dead-lettered for its delivery limit was admitted from {queue}");
                publish.extend(message);
            }
        }
        ctx.publish_outbox(&publish).await?;
        Ok(created)
    }
}
