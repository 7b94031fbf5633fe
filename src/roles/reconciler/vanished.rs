//! Vanished workers: `started` attempts silent past their deadline plus a
//! grace period become `unknown` (never `failed` by time alone: the
//! provider may still be working).

use crate::shared::runtime::{Context, Result};

/// Started attempts silent past their deadline plus the grace become `unknown`.
pub(super) async fn vanished_once(ctx: &Context) -> Result<()> {
    let grace = ctx.config.worker.vanished_grace;
    for id in ctx.store.sweeps().expire_vanished(grace).await? {
        tracing::warn!(attempt_id = %id, "worker vanished mid-call: attempt and job are now unknown");
    }
    Ok(())
}
