//! The relay: publishes outbox rows that are due and whose publisher's
//! lease ran out (the publisher crashed, or the broker was down), and the
//! delayed attempts that follow a failure once their backoff is over.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

use super::pass::Pass;

/// Outbox rows one relay statement takes at most.
const RELAY_BATCH: i64 = 256;

/// The relay pass, every `worker.relay_interval`.
pub struct Relay;

impl Pass for Relay {
    fn name(&self) -> &'static str {
        "relay"
    }

    fn every(&self, config: &Config) -> Duration {
        config.worker.relay_interval
    }

    /// Claims due rows, publishes them with confirms and marks them, a batch
    /// at a time until a batch comes back short. Returns the rows published.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let mut total = 0;
        loop {
            let batch = ctx.store.outbox().claim(RELAY_BATCH).await?;
            if batch.is_empty() {
                return Ok(total);
            }
            total += batch.len() as u64;
            tracing::debug!(rows = batch.len(), "relaying outbox rows");
            ctx.publish_outbox(&batch).await?;
            if batch.len() < RELAY_BATCH as usize {
                return Ok(total);
            }
        }
    }
}
