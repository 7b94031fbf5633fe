//! Pruning the outbox: published rows past `outbox_retention` are deleted.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

use super::pass::{Pass, sweep_every};

/// Rows one pruning statement deletes at most.
const BATCH: i64 = 1000;
/// Statements one run makes at most.
const BATCHES: usize = 10;

/// The outbox pruner, every second.
pub struct PruneOutbox;

impl Pass for PruneOutbox {
    fn name(&self) -> &'static str {
        "prune_outbox"
    }

    fn every(&self, config: &Config) -> Duration {
        sweep_every(config)
    }

    /// Deletes published outbox rows past `outbox_retention`, a bounded batch
    /// at a time, [`BATCHES`] at most, so that a large first prune spreads
    /// over several runs. Returns the rows deleted.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let retention = ctx.config.worker.outbox_retention;
        let mut total = 0;
        for _ in 0..BATCHES {
            let n = ctx.store.outbox().prune_outbox(retention, BATCH).await?;
            total += n;
            if n < BATCH as u64 {
                break;
            }
        }
        if total > 0 {
            tracing::debug!(rows = total, "pruned published outbox rows");
        }
        Ok(total)
    }
}
