//! Hedging: for operations with `hedge_after`, a job whose attempt has been
//! silent that long gets one parallel attempt on the next qualified provider.

use std::time::Duration;

use crate::shared::planner;
use crate::shared::runtime::{Context, Result};

/// Starts at most one hedge per job whose attempt has been silent for its
/// operation's `hedge_after`, on the next qualified provider other than its own.
pub(super) async fn hedge_once(ctx: &Context) -> Result<()> {
    let hedged: Vec<(String, Duration)> = ctx
        .config
        .operations
        .values()
        .filter_map(|o| o.hedge_after.map(|d| (o.name.clone(), d)))
        .collect();
    let candidates = ctx.store.sweeps().hedge_candidates(&hedged).await?;
    if candidates.is_empty() {
        return Ok(());
    }
    let planner = planner::load_all(&ctx.config, &ctx.store).await?;
    for candidate in candidates {
        let job = candidate.job_id;
        match planner.hedge_target(
            &candidate.operation,
            &candidate.provider,
            candidate.attempts_made,
        ) {
            Some(provider) => {
                if let Some(attempt) = ctx.store.sweeps().hedge(job, provider).await? {
                    tracing::info!(job_id = %job, attempt_id = %attempt, %provider, "hedging: a parallel attempt takes its turn");
                }
            }
            None => {
                tracing::debug!(job_id = %job, "no hedge: no other qualified provider, or attempts spent");
            }
        }
    }
    Ok(())
}
