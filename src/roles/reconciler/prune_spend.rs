//! Pruning spend: owners' spend rows older than a day are deleted (budgets
//! look back a day at most).

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

use super::pass::Pass;

/// Rows one run deletes at most.
const BATCH: i64 = 10_000;

/// The spend pruner, every ten seconds.
pub struct PruneSpend;

impl Pass for PruneSpend {
    fn name(&self) -> &'static str {
        "prune_spend"
    }

    fn every(&self, _: &Config) -> Duration {
        Duration::from_secs(10)
    }

    /// Deletes owners' spend older than a day, [`BATCH`] rows at most.
    /// Returns the rows deleted.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let n = ctx.store.owners().prune_spend(BATCH).await?;
        if n > 0 {
            tracing::debug!(rows = n, "pruned owners' spend older than a day");
        }
        Ok(n)
    }
}
