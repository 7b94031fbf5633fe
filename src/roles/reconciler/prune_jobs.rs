//! Pruning jobs: ended jobs past their retention are deleted with their
//! attempts, on a timer of their own, so that a large backlog of them never
//! holds up the relay.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::edges::store::Policy;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

use super::pass::Pass;

/// How often the job pruner looks for ended jobs past their retention.
const PRUNE_EVERY: Duration = Duration::from_secs(10);
/// Jobs one pruning statement deletes at most.
const PRUNE_BATCH: i64 = 1000;
/// Batches one run takes at most, with a pause between them, so that a large
/// first prune spreads over several runs.
const PRUNE_BATCHES: usize = 100;

/// The job pruner, every ten seconds.
pub struct PruneJobs;

impl Pass for PruneJobs {
    fn name(&self) -> &'static str {
        "prune_jobs"
    }

    fn every(&self, _: &Config) -> Duration {
        PRUNE_EVERY
    }

    /// Deletes ended jobs past their retention (and their attempts), batches
    /// until one comes back short, [`PRUNE_BATCHES`] at most, and stops early
    /// at a shutdown. Returns the jobs deleted.
    async fn once(&self, ctx: &Context, shutdown: &Shutdown) -> Result<u64> {
        let policy = Policy::of(&ctx.config);
        let pass = ctx
            .store
            .retention()
            .prune_batches(
                &policy,
                PRUNE_BATCH,
                PRUNE_BATCHES,
                Duration::from_millis(10),
                || shutdown.is_triggered(),
            )
            .await?;
        crate::edges::metrics::oldest_prunable(pass.oldest);
        let pruned = pass.pruned;
        if pruned.jobs > 0 {
            tracing::info!(
                jobs = pruned.jobs,
                attempts = pruned.attempts,
                "pruned ended jobs past their retention"
            );
        }
        Ok(pruned.jobs)
    }
}
