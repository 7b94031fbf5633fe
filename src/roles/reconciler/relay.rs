//! The relay: publishes outbox rows that are due and whose publisher's
//! lease ran out (the publisher crashed, or the broker was down), and the
//! delayed attempts that follow a failure once their backoff is over.

use crate::shared::runtime::{Context, Result};

/// Outbox rows one relay pass takes at most.
const RELAY_BATCH: i64 = 256;

/// One relay pass: claim due rows, publish them with confirms, mark them.
/// Returns how many rows it claimed.
pub(super) async fn relay_once(ctx: &Context) -> Result<usize> {
    let mut total = 0;
    loop {
        let batch = ctx.store.outbox().claim_outbox(RELAY_BATCH).await?;
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
