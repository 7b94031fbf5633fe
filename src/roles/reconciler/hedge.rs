//! Hedging: for operations with `hedge_after`, a job whose attempt has been
//! silent that long gets one parallel attempt on the next qualified provider.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::planner;
use crate::shared::runtime::{Context, Result};

use super::pass::{Pass, sweep_every};

/// The hedging sweep, every second.
pub struct Hedge;

impl Pass for Hedge {
    fn name(&self) -> &'static str {
        "hedge"
    }

    fn every(&self, config: &Config) -> Duration {
        sweep_every(config)
    }

    /// Starts at most one hedge per job whose attempt has been silent for its
    /// operation's `hedge_after`, on the next qualified provider other than
    /// its own. Returns the hedges started.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let hedged: Vec<(String, Duration)> = ctx
            .config
            .operations
            .values()
            .filter_map(|o| o.hedge_after.map(|d| (o.name.clone(), d)))
            .collect();
        let candidates = ctx.store.sweeps().hedge_candidates(&hedged).await?;
        if candidates.is_empty() {
            return Ok(0);
        }
        let planner = planner::load_all(&ctx.config, &ctx.store).await?;
        let mut started = 0;
        for candidate in candidates {
            let job = candidate.job_id;
            let target = planner.hedge_target(
                &candidate.operation,
                &candidate.provider,
                candidate.attempts_made,
            );
            let Some(provider) = target else {
                tracing::debug!(job_id = %job, "no hedge: no other qualified provider, or attempts spent");
                continue;
            };
            if let Some(attempt) = ctx.store.sweeps().hedge(job, provider).await? {
                started += 1;
                tracing::info!(job_id = %job, attempt_id = %attempt, %provider, "hedging: a parallel attempt takes its turn");
            }
        }
        Ok(started)
    }
}
