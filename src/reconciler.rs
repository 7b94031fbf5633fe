//! The reconciler role: the outbox relay and the vanished-worker sweep.
//!
//! The relay publishes outbox rows that are due and whose publisher's lease ran out
//! (the publisher crashed, or the broker was down), and the delayed attempts that
//! follow a failure once their backoff is over. The sweep turns `started` attempts
//! silent past their deadline plus a grace period into `unknown`: their worker
//! vanished, and the provider may still be working, so they are never `failed` by
//! time alone. Several reconcilers may run at once (`FOR UPDATE SKIP LOCKED`).

use std::time::Duration;

use crate::shutdown::Shutdown;
use crate::worker::{Context, Result};

/// Outbox rows one relay pass takes at most.
const RELAY_BATCH: i64 = 256;

/// Runs the relay and the sweep until shutdown.
pub async fn run(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let mut tick = tokio::time::interval(ctx.config.worker.relay_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sweep_every = Duration::from_secs(1);
    let mut last_sweep = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = shutdown.wait() => return Ok(()),
            _ = tick.tick() => {}
        }
        if let Err(e) = relay_once(&ctx).await {
            tracing::warn!(error = %e, "outbox relay pass failed; will retry");
        }
        if last_sweep.elapsed() >= sweep_every {
            last_sweep = tokio::time::Instant::now();
            match ctx
                .store
                .expire_vanished(ctx.config.worker.vanished_grace)
                .await
            {
                Ok(ids) if !ids.is_empty() => {
                    for id in ids {
                        tracing::warn!(attempt_id = %id, "worker vanished mid-call: attempt and job are now unknown");
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "vanished-worker sweep failed; will retry"),
            }
        }
    }
}

/// One relay pass: claim due rows, publish them with confirms, mark them.
/// Returns how many rows it claimed.
pub async fn relay_once(ctx: &Context) -> Result<usize> {
    let mut total = 0;
    loop {
        let batch = ctx.store.claim_outbox(RELAY_BATCH).await?;
        if batch.is_empty() {
            return Ok(total);
        }
        total += batch.len();
        tracing::debug!(rows = batch.len(), "relaying outbox rows");
        ctx.publish_outbox(&batch).await?;
        if batch.len() < RELAY_BATCH as usize {
            return Ok(total);
        }
    }
}
