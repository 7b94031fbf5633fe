//! `turns` vacuumed whenever its dead rows pass autovacuum's threshold,
//! every second, whether or not autovacuum runs: every job churns a row of
//! it, and its readers walk the dead index entries.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::shared::runtime::Context;

/// How often the dead rows of `turns` are looked at
/// ([`crate::edges::store::Turns::vacuum_turns_if_due`]).
const TURNS_VACUUM_EVERY: Duration = Duration::from_secs(1);

/// Vacuums `turns` when its dead rows are due, every [`TURNS_VACUUM_EVERY`],
/// until shutdown.
pub(super) async fn vacuum_turns_loop(ctx: Context, shutdown: Shutdown) {
    let mut failing = false;
    loop {
        match ctx.store.turns().vacuum_turns_if_due().await {
            Ok(vacuumed) => {
                if vacuumed {
                    crate::edges::metrics::vacuumed("turns");
                }
                failing = false;
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "vacuuming turns failed; will retry");
                }
                failing = true;
            }
        }
        tokio::select! {
            () = shutdown.wait() => return,
            () = tokio::time::sleep(TURNS_VACUUM_EVERY) => {}
        }
    }
}
