//! `turns` vacuumed whenever its dead rows pass autovacuum's threshold,
//! every second, whether or not autovacuum runs: every job churns a row of
//! it, and its readers walk the dead index entries.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

use super::pass::Pass;

/// The vacuum of `turns`, every second.
pub struct VacuumTurns;

impl Pass for VacuumTurns {
    fn name(&self) -> &'static str {
        "vacuum_turns"
    }

    fn every(&self, _: &Config) -> Duration {
        Duration::from_secs(1)
    }

    /// Vacuums `turns` when its dead rows are due
    /// ([`crate::edges::store::Turns::vacuum_if_due`]). Returns 1 when it did.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let vacuumed = ctx.store.turns().vacuum_if_due().await?;
        if vacuumed {
            crate::edges::metrics::vacuumed("turns");
        }
        Ok(u64::from(vacuumed))
    }
}
