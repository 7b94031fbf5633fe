//! Lost messages: `queued` attempts that never started long after their
//! message was published are republished, then failed with a reason after
//! `max_republish` tries.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::policy::next::FailedJob;
use crate::settings::config::Config;
use crate::shared::planner;
use crate::shared::runtime::{Context, Result};

use super::pass::{Pass, sweep_every};

/// The lost-message sweep, every second.
pub struct Lost;

impl Pass for Lost {
    fn name(&self) -> &'static str {
        "lost"
    }

    fn every(&self, config: &Config) -> Duration {
        sweep_every(config)
    }

    /// Queued attempts whose message seems lost (not started `stuck_after`
    /// after it was published, and not waiting in a backlog) are
    /// republished, and failed as lost after `max_republish` tries. Returns
    /// the attempts republished or failed.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let w = &ctx.config.worker;
        let max = i32::try_from(w.max_republish).unwrap_or(i32::MAX);
        let backlogged = backlogged(ctx).await;
        let (republish, lost) = ctx
            .store
            .sweeps()
            .stuck_queued(w.stuck_after, max, &backlogged)
            .await?;
        ctx.publish_outbox(&republish).await?;
        let done = (republish.len() + lost.len()) as u64;
        if lost.is_empty() {
            return Ok(done);
        }
        let planner = planner::load_all(&ctx.config, &ctx.store).await?;
        let plan = |f: &FailedJob| planner.plan(f);
        let error = format!(
            "attempt_lost: its message was republished {} times and the attempt never started",
            w.max_republish
        );
        let lost: Vec<_> = lost.into_iter().map(|a| (a, error.clone())).collect();
        let (_, publish) = ctx.store.settle().fail_queued(&lost, true, &plan).await?;
        ctx.publish_outbox(&publish).await?;
        Ok(done)
    }
}

/// The providers whose attempts queue holds messages now. An attempt of theirs
/// that has not started may simply be waiting in that backlog, so the stuck
/// sweep leaves it alone until the queue has drained, or has moved past it
/// ([`crate::edges::store::Sweeps::stuck_queued`]).
async fn backlogged(ctx: &Context) -> Vec<String> {
    let mut out = Vec::new();
    for provider in ctx.config.providers.keys() {
        let queue = crate::broker::attempts_queue(provider);
        match crate::broker::depth(&ctx.connection, &queue).await {
            Ok(0) => {}
            Ok(_) => out.push(provider.clone()),
            // Not knowing, take it for backlogged: only what its queue has
            // moved past is taken this pass; the rest goes on.
            Err(e) => {
                tracing::warn!(%queue, error = %e, "cannot read the queue's depth");
                out.push(provider.clone());
            }
        }
    }
    out
}
