//! Pruning: ended jobs past their retention, with their attempts (in a
//! loop of its own, so that a large backlog of them never holds up the
//! relay), owners' spend older than a day, and published outbox rows past
//! `outbox_retention`; and the vacuum of the busy tables where the server
//! runs no autovacuum.

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::shared::runtime::{Context, Result};

/// How often the job pruner looks for ended jobs past their retention.
const PRUNE_EVERY: Duration = Duration::from_secs(10);
/// Jobs one pruning statement deletes at most.
const PRUNE_BATCH: i64 = 1000;
/// Batches one pruning pass runs at most, with a pause between them, so that a
/// large first prune spreads over several passes.
const PRUNE_BATCHES: usize = 100;

/// Prunes ended jobs past their retention every [`PRUNE_EVERY`] until shutdown.
pub(super) async fn prune_loop(ctx: Context, shutdown: Shutdown) {
    let policy = crate::edges::store::Policy::of(&ctx.config);
    loop {
        match prune_jobs(&ctx, &policy, &shutdown).await {
            Ok(p) if p.jobs > 0 => {
                tracing::info!(
                    jobs = p.jobs,
                    attempts = p.attempts,
                    "pruned ended jobs past their retention"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "pruning ended jobs failed; will retry"),
        }
        match ctx.store.owners().prune_spend(10_000).await {
            Ok(n) if n > 0 => tracing::debug!(rows = n, "pruned owners' spend older than a day"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "pruning owners' spend failed; will retry"),
        }
        match ctx.store.retention().vacuum_if_due().await {
            Ok(tables) => {
                for table in tables {
                    crate::edges::metrics::vacuumed(&table);
                    tracing::info!(%table, "vacuumed (the server runs no autovacuum)");
                }
            }
            Err(e) => tracing::warn!(error = %e, "vacuuming failed; will retry"),
        }
        tokio::select! {
            () = shutdown.wait() => return,
            () = tokio::time::sleep(PRUNE_EVERY) => {}
        }
    }
}

/// One pruning pass: batches until one comes back short (or [`PRUNE_BATCHES`]).
pub(super) async fn prune_jobs(
    ctx: &Context,
    policy: &crate::edges::store::Policy,
    shutdown: &Shutdown,
) -> Result<crate::edges::store::Pruned> {
    let pass = ctx
        .store
        .retention()
        .prune_batches(
            policy,
            PRUNE_BATCH,
            PRUNE_BATCHES,
            Duration::from_millis(10),
            || shutdown.is_triggered(),
        )
        .await?;
    crate::edges::metrics::oldest_prunable(pass.oldest);
    Ok(pass.pruned)
}

/// Deletes published outbox rows past `outbox_retention`, a bounded batch at a
/// time, at most ten batches a pass, so that a large first prune does not hold up
/// the relay and the sweeps.
pub(super) async fn prune_outbox(ctx: &Context) -> Result<u64> {
    const BATCH: i64 = 1000;
    let mut total = 0;
    for _ in 0..10 {
        let n = ctx
            .store
            .outbox()
            .prune_outbox(ctx.config.worker.outbox_retention, BATCH)
            .await?;
        total += n;
        if n < BATCH as u64 {
            break;
        }
    }
    Ok(total)
}
