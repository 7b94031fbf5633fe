//! Unserved turns: turns held for a provider this worker's configuration no
//! longer has fail `provider_not_served`, and their jobs move on.

use std::time::Duration;

use crate::domain;
use crate::edges::shutdown::Shutdown;
use crate::policy::next::FailedJob;
use crate::settings::config::Config;
use crate::shared::planner;
use crate::shared::runtime::{Context, Result};

use super::pass::{Pass, sweep_every};

/// Turns one run fails at most.
const UNSERVED_BATCH: i64 = 100;

/// The unserved-turn sweep, every second.
pub struct Unserved;

impl Pass for Unserved {
    fn name(&self) -> &'static str {
        "unserved"
    }

    fn every(&self, config: &Config) -> Duration {
        sweep_every(config)
    }

    /// Turns held for a provider this worker's configuration no longer has
    /// (removed or renamed), for longer than `stuck_after`: only a consumer
    /// of a turn's provider hands it out, so they would wait for ever. Each
    /// fails `provider_not_served`, and its job moves on along its route (or
    /// fails, as the route rule says). Returns the turns failed.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let served = ctx.config.provider_names();
        let stuck_after = ctx.config.worker.stuck_after;
        let unserved = ctx
            .store
            .turns()
            .unserved_turns(&served, stuck_after, UNSERVED_BATCH)
            .await?;
        if unserved.is_empty() {
            return Ok(0);
        }
        let failures: Vec<(domain::AttemptId, String)> = unserved
            .into_iter()
            .map(|(attempt, provider)| {
                let why = format!(
                    "provider_not_served: provider {provider:?} is not configured, and its turn was held past worker.stuck_after ({}); the route moves on",
                    humantime::format_duration(stuck_after)
                );
                tracing::warn!(attempt_id = %attempt, %provider, "a held turn's provider is not configured: its attempt fails and the route moves on");
                (attempt, why)
            })
            .collect();
        let planner = planner::load_all(&ctx.config, &ctx.store).await?;
        let plan = |f: &FailedJob| planner.plan(f);
        let settle = ctx.store.settle();
        let (failed, publish) = settle.fail_queued(&failures, true, &plan).await?;
        ctx.publish_outbox(&publish).await?;
        Ok(failed.len() as u64)
    }
}
