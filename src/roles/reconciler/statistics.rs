//! Statistics: the busy tables are analyzed when their statistics are
//! missing or far behind, as on a fresh database taking a backlog
//! ([`crate::edges::store::Sweeps::refresh_statistics`]).

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

use super::pass::{Pass, sweep_every};

/// The statistics pass, every second.
pub struct Statistics;

impl Pass for Statistics {
    fn name(&self) -> &'static str {
        "statistics"
    }

    fn every(&self, config: &Config) -> Duration {
        sweep_every(config)
    }

    /// Analyzes the busy tables whose statistics are due. Returns how many
    /// it analyzed.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let tables = ctx.store.sweeps().refresh_statistics().await?;
        if !tables.is_empty() {
            tracing::debug!(?tables, "refreshed the planner's statistics");
        }
        Ok(tables.len() as u64)
    }
}
