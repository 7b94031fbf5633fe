//! Kept answers: an answer whose rows were held under someone else's lock
//! when it arrived, or that evidence found, was kept on its attempt; it is
//! settled here, as a live answer would be.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::edges::store::Settled;
use crate::policy::next::FailedJob;
use crate::settings::config::Config;
use crate::shared::planner;
use crate::shared::runtime::{Context, Result};

use super::pass::{Pass, sweep_every};

/// Kept answers one run settles at most.
const KEPT_BATCH: i64 = 100;
/// How long a kept answer whose rows were held waits before it is tried again.
const KEPT_HELD_PAUSE: Duration = Duration::from_secs(5);

/// The kept-answer sweep, every second.
pub struct Kept;

impl Pass for Kept {
    fn name(&self) -> &'static str {
        "kept"
    }

    fn every(&self, config: &Config) -> Duration {
        sweep_every(config)
    }

    /// Settles the answers that were kept on their attempts because their
    /// rows were held when they arrived ([`crate::edges::store::Kept::keep_answer`]),
    /// or because evidence found them: by the same settlement as a live
    /// answer, so a job that ended meanwhile discards it with its usage kept.
    /// The settlement clears each answer it settles. One whose rows are still
    /// held, or that Postgres refused, is moved behind the others
    /// ([`KEPT_HELD_PAUSE`]), so that answers the pass cannot settle never keep
    /// it from those it can. Returns the answers settled.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let kept = ctx.store.kept().answers(KEPT_BATCH).await?;
        if kept.is_empty() {
            return Ok(0);
        }
        let planner = planner::load_all(&ctx.config, &ctx.store).await?;
        let plan = |f: &FailedJob| planner.plan(f);
        let (settled, publish) = ctx.store.settle().finalize(&kept, &plan).await?;
        let mut later = Vec::new();
        for (finished, settled) in kept.iter().zip(&settled) {
            match settled {
                Settled::Busy | Settled::Refused { .. } => later.push(finished.attempt_id),
                _ => {
                    tracing::info!(attempt_id = %finished.attempt_id, job_id = %finished.job_id, ?settled, "a kept answer was settled")
                }
            }
        }
        ctx.store.kept().later(&later, KEPT_HELD_PAUSE).await?;
        ctx.publish_outbox(&publish).await?;
        Ok((kept.len() - later.len()) as u64)
    }
}
