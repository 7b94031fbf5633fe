//! Unserved turns: turns held for a provider this worker's configuration no
//! longer has fail `provider_not_served`, and their jobs move on.

use crate::domain;
use crate::policy::next::FailedJob;
use crate::shared::planner;
use crate::shared::runtime::{Context, Result};

/// Turns held for a provider this worker's configuration no longer has
/// (removed or renamed), for longer than `stuck_after`: only a consumer of a
/// turn's provider hands it out, so they would wait for ever. Each fails
/// `provider_not_served`, and its job moves on along its route (or fails, as
/// the route rule says).
pub(super) async fn unserved_once(ctx: &Context) -> Result<()> {
    let served = ctx.config.provider_names();
    let unserved = ctx
        .store
        .turns()
        .unserved_turns(&served, ctx.config.worker.stuck_after, 100)
        .await?;
    if unserved.is_empty() {
        return Ok(());
    }
    let failures: Vec<(domain::AttemptId, String)> = unserved
        .into_iter()
        .map(|(attempt, provider)| {
            let why = format!(
                "provider_not_served: provider {provider:?} is not configured, and its turn was held past worker.stuck_after ({}); the route moves on",
                humantime::format_duration(ctx.config.worker.stuck_after)
            );
            tracing::warn!(attempt_id = %attempt, %provider, "a held turn's provider is not configured: its attempt fails and the route moves on");
            (attempt, why)
        })
        .collect();
    let planner = planner::load_all(&ctx.config, &ctx.store).await?;
    let plan = |f: &FailedJob| planner.plan(f);
    let (_, publish) = ctx
        .store
        .settle()
        .fail_queued(&failures, true, &plan)
        .await?;
    ctx.publish_outbox(&publish).await?;
    Ok(())
}
