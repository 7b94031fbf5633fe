//! Handing out turns: a provider's held first attempts go to its queue as
//! their owners' earlier turns start ([`crate::edges::store::Turns::hand_out_turns`]).
//! Each worker's consumer runs one for its provider, woken by its own claims
//! and settlements (a claim frees a place in the owner's share, a settlement
//! frees one under its `max_in_flight`), and by a short tick for what other
//! workers freed. Hand-outs on several workers take their owners' turns
//! apart (`FOR UPDATE SKIP LOCKED`), and count `max_in_flight` under the
//! owner's lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::edges::shutdown::Shutdown;
use crate::shared::runtime::Context;

/// How often a hand-out looks without being woken: what other workers'
/// claims and settlements freed waits at most this long.
const TICK: Duration = Duration::from_millis(100);

/// How much of the provider's recent starts an owner's share covers at
/// least: a fast provider's share grows with its pace, so that the hand-outs'
/// own round trips never leave its slots idle, while another owner's job
/// still waits behind no more than this much of a backlogged owner's work.
const SHARE_TIME: Duration = Duration::from_millis(100);
/// The largest share, however fast the provider.
const SHARE_MAX: i64 = 4096;

/// An owner's share of the provider's queue: the configured one (half a
/// worker's slots), or [`SHARE_TIME`] of the attempts this worker started on
/// the provider lately, whichever is more.
pub(super) struct Share {
    least: i64,
    /// Attempts started on the provider by this worker, ever.
    pub(super) started: AtomicU64,
    /// The count and time of the last look, and the share it set.
    last: std::sync::Mutex<(u64, Instant, i64)>,
}

impl Share {
    pub(super) fn new(least: i64) -> Share {
        Share {
            least,
            started: AtomicU64::new(0),
            last: std::sync::Mutex::new((0, Instant::now(), least)),
        }
    }

    /// The share now: the start rate is measured over the last half second
    /// or more, and its [`SHARE_TIME`]'s worth rounded down, so that the
    /// starts a short look happens to catch together do not raise a slow
    /// provider's share.
    fn now(&self) -> i64 {
        let Ok(mut last) = self.last.lock() else {
            return self.least;
        };
        let elapsed = last.1.elapsed();
        if elapsed >= Duration::from_millis(500) {
            let started = self.started.load(Ordering::Relaxed);
            let rate = started.saturating_sub(last.0) as f64 / elapsed.as_secs_f64();
            let paced = (rate * SHARE_TIME.as_secs_f64()).floor() as i64;
            *last = (started, Instant::now(), paced.clamp(self.least, SHARE_MAX));
        }
        last.2
    }
}

/// Hands out `provider`'s held turns until shutdown.
pub(super) async fn hand_out(
    ctx: Context,
    provider: String,
    share: Arc<Share>,
    wake: Arc<Notify>,
    shutdown: Shutdown,
) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    // While the last look found nothing held, wakes are not worth a look
    // each (a claim or a settlement for every job): the tick finds the first
    // turns held, and from then on every wake looks.
    let mut idle = false;
    // Where the next look begins: after the last owner this one looked at.
    let mut after = String::new();
    loop {
        tokio::select! {
            () = shutdown.wait() => return,
            () = wake.notified(), if !idle => {}
            _ = tick.tick() => {}
        }
        let handed = match ctx
            .store
            .turns()
            .hand_out_turns(&provider, share.now(), &after)
            .await
        {
            Ok(out) => {
                idle = !out.waiting;
                after = out.looked_to;
                out.publish
            }
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
        crate::edges::metrics::turns_handed_out(&provider, handed.len());
        // A publish that fails is the relay's: the rows are in the outbox.
        if let Err(e) = ctx.publish_outbox(&handed).await {
            tracing::warn!(error = %e, %provider, "publishing handed-out turns failed; the relay will retry");
        }
    }
}
