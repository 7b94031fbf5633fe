//! Handing out turns: a provider's held first attempts go to its queue as
//! their owners' earlier turns start ([`crate::store::Store::hand_out_turns`]).
//! Each worker's consumer runs one for its provider, woken by its own claims
//! and settlements (a claim frees a place in the owner's share, a settlement
//! frees one under its `max_in_flight`), and by a short tick for what other
//! workers freed. Hand-outs on several workers take their owners' turns
//! apart (`FOR UPDATE SKIP LOCKED`), and count `max_in_flight` under the
//! owner's lock.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::runtime::Context;
use crate::shutdown::Shutdown;

/// How often a hand-out looks without being woken: what other workers'
/// claims and settlements freed waits at most this long.
const TICK: Duration = Duration::from_millis(100);

/// Hands out `provider`'s held turns until shutdown.
pub(super) async fn hand_out(
    ctx: Context,
    provider: String,
    share: i64,
    wake: Arc<Notify>,
    shutdown: Shutdown,
) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            () = shutdown.wait() => return,
            () = wake.notified() => {}
            _ = tick.tick() => {}
        }
        let handed = match ctx.store.hand_out_turns(&provider, share).await {
            Ok(handed) => handed,
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, %provider, "handing out turns failed; trying again");
                }
                failing = true;
                continue;
            }
        };
        if failing {
            tracing::info!(%provider, "handing out turns works again");
            failing = false;
        }
        if handed.is_empty() {
            continue;
        }
        crate::metrics::turns_handed_out(&provider, handed.len());
        // A publish that fails is the relay's: the rows are in the outbox.
        if let Err(e) = ctx.publish_outbox(&handed).await {
            tracing::warn!(error = %e, %provider, "publishing handed-out turns failed; the relay will retry");
        }
    }
}
