//! Dead-lettered attempts: an attempt whose message died in its dead-letter
//! queue (the delivery limit, say) while the attempt was still `queued` is
//! failed with the dead letter's reason, and the route rule plans what
//! follows. Each letter stays for an operator.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::policy::next::FailedJob;
use crate::settings::config::Config;
use crate::shared::planner;
use crate::shared::runtime::{Context, Result};

use super::pass::Pass;

/// Letters one run reads at most, per queue.
const LETTERS: usize = 256;

/// The dead-lettered attempts' scan, every `worker.dead_letter_scan`.
pub struct DeadAttempts;

impl Pass for DeadAttempts {
    fn name(&self) -> &'static str {
        "dead_attempts"
    }

    fn every(&self, config: &Config) -> Duration {
        config.worker.dead_letter_scan
    }

    /// Marks attempts whose messages died in their dead-letter queue while
    /// they were still `queued`: `failed`, with the dead letter's reason, and
    /// plans the next attempt. Browsing returns every dead letter to its
    /// queue. Returns the attempts failed.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let mut dead = Vec::new();
        for provider in ctx.config.providers.keys() {
            let attempts = crate::broker::attempts_queue(provider);
            let queue = crate::broker::dead_letter_queue(&attempts);
            crate::shared::dlq::visit(&ctx.connection, &queue, LETTERS, |letter, delivery| {
                if let Ok(message) =
                    serde_json::from_slice::<crate::domain::AttemptMessage>(&delivery.data)
                {
                    dead.push((
                        message.attempt_id,
                        format!("dead_lettered: {} (see {queue})", letter.reason),
                    ));
                }
            })
            .await?;
        }
        if dead.is_empty() {
            return Ok(0);
        }
        let planner = planner::load_all(&ctx.config, &ctx.store).await?;
        let plan = |f: &FailedJob| planner.plan(f);
        let (settled, publish) = ctx.store.settle().fail_queued(&dead, true, &plan).await?;
        for (attempt, _) in &settled {
            tracing::warn!(attempt_id = %attempt, "attempt's message was dead-lettered: attempt marked failed");
        }
        ctx.publish_outbox(&publish).await?;
        Ok(settled.len() as u64)
    }
}
