//! Reserving before a start: attempts a claim left `queued` because their
//! owner has a budget and they hold no reservation (a retry, a hedge, a job
//! admitted before its owner had a budget) reserve their prompt's tokens plus
//! their operation's `max_tokens` (contract section 7, Owners), and are
//! claimed again; those whose reservation does not fit never start: each
//! fails with `budget_exceeded`, not retryable, so its job ends `failed`
//! (a hedge's job carries on with its other attempt).

use crate::policy::next::FailedJob;
use std::collections::HashMap;

use crate::domain::AttemptId;
use crate::edges::shutdown::Shutdown;
use crate::edges::store::{Claim, Reservation, Unreserved};
use crate::policy::next::Planner;
use crate::shared::runtime::{Context, with_retries};

/// Reserves for `claim`'s unreserved attempts, and returns those that now
/// hold a reservation, for the claim to claim again under its token.
/// Attempts refused for their budget are failed, and left out: they were
/// not started. When the reservations cannot be made, every one is busy
/// (claimed again later).
pub(super) async fn reserve_for(
    ctx: &Context,
    shutdown: &Shutdown,
    claim: &mut Claim,
) -> Vec<AttemptId> {
    let unreserved = std::mem::take(&mut claim.unreserved);
    let wanted: Vec<Reservation> = unreserved.iter().map(|u| reservation(ctx, u)).collect();
    let reserved = with_retries(shutdown, "reserving of budgets", || async {
        Ok(ctx.store.owners().reserve(&wanted).await?)
    })
    .await;
    let refused = match reserved {
        Ok(refused) => refused,
        Err(e) => {
            tracing::warn!(error = %e, "attempts could not reserve of their owners' budgets; claimed again later");
            claim.busy.extend(unreserved.iter().map(|u| u.attempt_id));
            return Vec::new();
        }
    };
    if !fail_refused(ctx, shutdown, &refused).await {
        claim.busy.extend(refused.keys().copied());
    }
    unreserved
        .iter()
        .map(|u| u.attempt_id)
        .filter(|id| !refused.contains_key(id))
        .collect()
}

/// What an attempt reserves: its prompt's tokens, rendered from its job's
/// input, plus its operation's `max_tokens` (only `max_tokens` when the input
/// no longer renders; nothing when the operation is no longer configured:
/// its call fails before it is sent).
fn reservation(ctx: &Context, u: &Unreserved) -> Reservation {
    let config = &ctx.config;
    let tokens =
        config
            .operations
            .get(&u.operation)
            .map_or(0, |op| match config.render(op, &u.input) {
                Ok(rendered) => {
                    crate::shared::runtime::reservation(config, op, &op.route[0], &rendered)
                }
                Err(_) => i64::from(op.max_tokens),
            });
    Reservation {
        attempt_id: u.attempt_id,
        owner_id: u.owner_id.clone(),
        tokens,
    }
}

/// Fails the attempts whose reservation did not fit, each with its refusal,
/// not retryable; publishes what the failures wrote (the relay does, if this
/// cannot). Whether they were failed: if not, they stay `queued`, and their
/// deliveries are claimed again later.
async fn fail_refused(
    ctx: &Context,
    shutdown: &Shutdown,
    refused: &HashMap<AttemptId, crate::intent::RejectReason>,
) -> bool {
    if refused.is_empty() {
        return true;
    }
    let failures: Vec<(AttemptId, String)> = refused
        .iter()
        .map(|(id, why)| (*id, why.to_string()))
        .collect();
    for (id, why) in &failures {
        tracing::warn!(attempt_id = %id, reason = %why, "an attempt's reservation does not fit its owner's budget: it fails before its call");
    }
    let planner = Planner::unqualified(&ctx.config);
    let plan = |f: &FailedJob| planner.plan(f);
    let failed = with_retries(shutdown, "failing attempts over their budget", || async {
        Ok(ctx
            .store
            .settle()
            .fail_queued(&failures, false, &plan)
            .await?)
    })
    .await;
    match failed {
        Ok((_, publish)) => {
            if let Err(e) = ctx.publish_outbox(&publish).await {
                tracing::warn!(error = %e, "what failed attempts wrote is not all published yet; the relay will");
            }
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "attempts over their budget could not be failed yet; claimed again later");
            false
        }
    }
}
