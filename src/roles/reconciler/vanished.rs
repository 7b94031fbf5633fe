//! Vanished workers: `started` attempts silent past their deadline plus a
//! grace period become `unknown` (never `failed` by time alone: the
//! provider may still be working).

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

use super::pass::{Pass, sweep_every};

/// The vanished-worker sweep, every second.
pub struct Vanished;

impl Pass for Vanished {
    fn name(&self) -> &'static str {
        "vanished"
    }

    fn every(&self, config: &Config) -> Duration {
        sweep_every(config)
    }

    /// Started attempts silent past their deadline plus `worker.vanished_grace`
    /// become `unknown`. Returns how many did.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let grace = ctx.config.worker.vanished_grace;
        let expired = ctx.store.sweeps().expire_vanished(grace).await?;
        for id in &expired {
            tracing::warn!(attempt_id = %id, "worker vanished mid-call: attempt and job are now unknown");
        }
        Ok(expired.len() as u64)
    }
}
