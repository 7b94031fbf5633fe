//! Vacuum: the busy tables are vacuumed where the server runs no
//! autovacuum, so that their dead rows never pile up.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

use super::pass::Pass;

/// The vacuum pass, every ten seconds.
pub struct Vacuum;

impl Pass for Vacuum {
    fn name(&self) -> &'static str {
        "vacuum"
    }

    fn every(&self, _: &Config) -> Duration {
        Duration::from_secs(10)
    }

    /// Vacuums the busy tables that are due, when the server runs no
    /// autovacuum ([`crate::edges::store::Pruning::vacuum_if_due`]). Returns
    /// how many it vacuumed.
    async fn once(&self, ctx: &Context, _: &Shutdown) -> Result<u64> {
        let tables = ctx.store.retention().vacuum_if_due().await?;
        for table in &tables {
            crate::edges::metrics::vacuumed(table);
            tracing::info!(%table, "vacuumed (the server runs no autovacuum)");
        }
        Ok(tables.len() as u64)
    }
}
