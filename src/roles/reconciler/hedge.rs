//! Hedging: for operations with `hedge_after`, a job whose attempt has been
//! silent that long gets one parallel attempt on the next qualified provider.

use std::time::Duration;

use crate::domain::{self, GiveUp};
use crate::shared::policy::Planner;
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
    let candidates = ctx.store.hedge_candidates(&hedged).await?;
    if candidates.is_empty() {
        return Ok(());
    }
    let planner = Planner::load_all(&ctx.config, &ctx.store).await?;
    for candidate in candidates {
        let job = candidate.job_id;
        let (current, operation) = (candidate.provider.as_str(), candidate.operation.as_str());
        let Some(op) = ctx.config.operations.get(operation) else {
            continue;
        };
        let target = domain::next_provider(
            &op.route,
            |p| p != current && planner.is_eligible(operation, p),
            current,
            candidate.attempts_made,
            op.max_attempts,
        );
        match target {
            Ok(provider) => {
                if let Some(attempt) = ctx.store.hedge(job, provider).await? {
                    tracing::info!(job_id = %job, attempt_id = %attempt, %provider, "hedging: a parallel attempt takes its turn");
                }
            }
            Err(GiveUp::AttemptsSpent { .. } | GiveUp::NoEligibleProvider) => {
                tracing::debug!(job_id = %job, "no hedge: no other qualified provider, or attempts spent");
            }
        }
    }
    Ok(())
}
