//! Settlements handed on through the broker ([`crate::shared::handed_on`]): each one
//! that names the claim its open attempt was started under is kept on that
//! attempt, for the kept-answer pass to settle by the same compare-and-swap
//! as a live answer; one whose attempt was settled meanwhile (a duplicate)
//! settles nothing; anything else (a forgery, a malformed or oversize body)
//! is dead-lettered with the reason. A delivery is acked only once what it
//! carried is kept, or dead-lettered; while Postgres is unreachable it is
//! held, and handed back at a stop.

use std::time::Duration;

use lapin::message::Delivery;

use crate::broker::{SETTLEMENTS_QUEUE, escape_controls};
use crate::edges::shutdown::Shutdown;
use crate::edges::store::HandedOn;
use crate::shared::handed_on::Settlement;
use crate::shared::runtime::{self, Context, Result, WorkerError, with_retries};

/// Settlements taken at once.
const PREFETCH: u16 = 8;
/// The pause before a settlement whose attempt row is held is tried again.
const HELD_PAUSE: Duration = Duration::from_millis(200);

/// Takes handed-on settlements until shutdown.
pub(super) async fn consume(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let limit = crate::shared::handed_on::limit(&ctx.config);
    runtime::consume(&ctx, SETTLEMENTS_QUEUE, PREFETCH, &shutdown, |delivery| {
        let (ctx, shutdown) = (ctx.clone(), shutdown.clone());
        async move { handle(&ctx, &shutdown, delivery, limit).await }
    })
    .await
}

/// One delivery, from its body to its ack (or its return to the queue).
async fn handle(ctx: &Context, shutdown: &Shutdown, delivery: Delivery, limit: usize) {
    let done = match take(ctx, shutdown, &delivery, limit).await {
        Ok(()) => runtime::ack(&delivery).await,
        Err(e) => Err(e),
    };
    if let Err(e) = done {
        tracing::warn!(error = %e, "a handed-on settlement was not taken; it goes back to its queue");
        runtime::requeue(&delivery).await;
    }
}

/// Keeps what `delivery` carries on its attempt, or dead-letters it.
async fn take(ctx: &Context, shutdown: &Shutdown, delivery: &Delivery, limit: usize) -> Result<()> {
    let settlement = match Settlement::parse(&delivery.data, limit) {
        Ok(s) => s,
        Err(reason) => return refuse(ctx, shutdown, delivery, &reason).await,
    };
    let finished = settlement.finished();
    loop {
        let kept = with_retries(shutdown, "keeping a handed-on settlement", || async {
            Ok(ctx
                .store
                .kept()
                .keep_handed_on(&finished, settlement.claim)
                .await?)
        })
        .await;
        match kept {
            Ok(HandedOn::Kept) => {
                tracing::info!(attempt_id = %settlement.attempt_id, job_id = %settlement.job_id, "a handed-on settlement is kept on its attempt, for the kept-answer pass to settle");
                crate::edges::metrics::settlement_handed_on("kept");
                return Ok(());
            }
            Ok(HandedOn::Settled) => {
                tracing::info!(attempt_id = %settlement.attempt_id, "a handed-on settlement's attempt was settled already: it settles nothing");
                crate::edges::metrics::settlement_handed_on("settled_already");
                return Ok(());
            }
            Ok(HandedOn::NoSuchClaim) => {
                let reason = format!(
                    "settlement_refused: no attempt {} of job {} was started under the claim it names",
                    settlement.attempt_id, settlement.job_id
                );
                return refuse(ctx, shutdown, delivery, &reason).await;
            }
            Ok(HandedOn::Held) => {}
            Err(WorkerError::Store(e)) if e.is_data_error() => {
                let reason = format!("settlement_refused: Postgres refused it: {e}");
                return refuse(ctx, shutdown, delivery, &reason).await;
            }
            Err(e) => return Err(e),
        }
        tokio::select! {
            () = shutdown.wait() => return Err(WorkerError::Unsettled(
                "the worker is stopping while the settlement's attempt row is held".into(),
            )),
            () = tokio::time::sleep(HELD_PAUSE) => {}
        }
    }
}

/// Dead-letters a delivery that settles nothing, with the reason.
async fn refuse(
    ctx: &Context,
    shutdown: &Shutdown,
    delivery: &Delivery,
    reason: &str,
) -> Result<()> {
    tracing::warn!(reason = %escape_controls(reason), "a message on {SETTLEMENTS_QUEUE} settles nothing: dead-lettered");
    crate::edges::metrics::settlement_handed_on("refused");
    with_retries(shutdown, "dead-lettering a settlement", || {
        ctx.publish_dead_letter(SETTLEMENTS_QUEUE, delivery, reason)
    })
    .await
}
