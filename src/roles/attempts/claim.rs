//! Claiming: every delivery that got its slot while the previous claim
//! committed is moved `queued → started` by one guarded statement, which
//! commits before any request leaves.

use std::collections::{BTreeSet, HashMap};

use crate::domain::AttemptId;
use crate::edges::provider::Client;
use crate::edges::shutdown::Shutdown;
use crate::edges::store::Started;
use crate::shared::runtime::Unheard;
use crate::shared::runtime::{Context, with_retries};

/// A claim's answer, or why the claim was not made.
pub(super) type Claimed = std::result::Result<ClaimAnswer, String>;

/// What a claim did with one attempt.
#[derive(Debug)]
pub(super) enum ClaimAnswer {
    /// Started (under the claim's token): call its provider.
    Started(Started, uuid::Uuid),
    /// Its job row was held under someone else's lock: claim it again later.
    Busy,
    /// Not started (a duplicate delivery, a blocked or ended job, no attempt).
    NotStarted,
}

/// A claim flush: moves the attempts `queued → started` with one statement.
pub(super) async fn claim(
    ctx: &Context,
    shutdown: &Shutdown,
    client: &Client,
    ids: Vec<AttemptId>,
) -> Vec<Claimed> {
    let provider = client.provider();
    crate::edges::metrics::attempt_batch(&provider.name, "claim", ids.len());
    // One token for every try of this claim: a try whose commit took effect
    // unseen is found again by the next (Settle::claim). Random, not
    // time-ordered: it is the secret a settlement handed on through the
    // broker proves its origin by.
    let token = uuid::Uuid::new_v4();
    let claimed = claim_under(ctx, shutdown, client, &ids, token).await;
    match claimed {
        Ok(mut claim) => {
            if !claim.unreserved.is_empty() {
                let again = super::reserve::reserve_for(ctx, shutdown, &mut claim).await;
                claim_again(ctx, shutdown, client, &mut claim, again, token).await;
            }
            let busy: BTreeSet<AttemptId> = claim.busy.into_iter().collect();
            crate::edges::metrics::attempt_claims_held(&provider.name, busy.len());
            let mut started: HashMap<AttemptId, Started> = claim
                .started
                .into_iter()
                .map(|s| (s.attempt_id, s))
                .collect();
            ids.iter()
                .map(|id| {
                    Ok(match started.remove(id) {
                        Some(s) => ClaimAnswer::Started(s, token),
                        None if busy.contains(id) => ClaimAnswer::Busy,
                        None => ClaimAnswer::NotStarted,
                    })
                })
                .collect()
        }
        Err(e) => {
            // Whether a try took effect is not known: what it may have started
            // goes back to `queued`, so no attempt is left started with no call.
            let handed_back = with_retries(shutdown, "handing back a claim", || async {
                Ok(ctx.store.settle().unclaim(token).await?)
            })
            .await;
            if let Err(back) = handed_back {
                tracing::error!(error = %back, %token, "a failed claim could not be handed back; the vanished sweep will find its attempts");
            }
            let why = e.to_string();
            ids.iter().map(|_| Err(why.clone())).collect()
        }
    }
}

/// One claim of `ids` under `token` ([`crate::edges::store::Settle::claim`]), its
/// transient failures tried again.
pub(super) async fn claim_under(
    ctx: &Context,
    shutdown: &Shutdown,
    client: &Client,
    ids: &[AttemptId],
    token: uuid::Uuid,
) -> Result<crate::edges::store::Claim, crate::shared::runtime::WorkerError> {
    let provider = client.provider();
    with_retries(shutdown, "starting attempts", || async {
        Ok(ctx
            .store
            .settle()
            .claim(
                &provider.name,
                provider.evidence.kind.as_str(),
                ids,
                provider.timeout,
                token,
            )
            .await?)
    })
    .await
}

/// Claims again, under the claim's `token`, the attempts that now hold a
/// reservation ([`super::reserve::reserve_for`]): what it starts joins
/// `claim`'s, and what it cannot start yet is busy (claimed again later).
async fn claim_again(
    ctx: &Context,
    shutdown: &Shutdown,
    client: &Client,
    claim: &mut crate::edges::store::Claim,
    again: Vec<AttemptId>,
    token: uuid::Uuid,
) {
    if again.is_empty() {
        return;
    }
    match claim_under(ctx, shutdown, client, &again, token).await {
        Ok(second) => {
            claim.started.extend(second.started);
            claim.busy.extend(second.busy);
            // Still unreserved: the owner's budget changed meanwhile.
            claim
                .busy
                .extend(second.unreserved.iter().map(|u| u.attempt_id));
        }
        Err(e) => {
            // Whether a try took effect is not known: what it may have
            // started under the token goes back to `queued` (one by one: the
            // first claim's attempts started under it too), so none is left
            // started with no call.
            tracing::warn!(error = %e, "reserved attempts were not claimed; claimed again later");
            for id in &again {
                if let Err(e) = ctx.store.settle().unclaim_attempt(*id, token).await {
                    tracing::error!(attempt_id = %id, error = %e, "a failed claim could not be handed back; the vanished sweep will find its attempt");
                }
            }
            claim.busy.extend(again);
        }
    }
}

/// What becomes of a claim whose handler was cut off while its flush ran
/// (the end of a stop's grace): an attempt it started is handed back to
/// `queued` at once, for its redelivered message, never left `started` with
/// no call (which the vanished sweep would make `unknown`).
pub(super) fn hand_back(ctx: &Context) -> Unheard<Claimed> {
    let ctx = ctx.clone();
    std::sync::Arc::new(move |claimed: Claimed| {
        let ctx = ctx.clone();
        Box::pin(async move {
            let Ok(ClaimAnswer::Started(started, token)) = claimed else {
                return;
            };
            match ctx
                .store
                .settle()
                .unclaim_attempt(started.attempt_id, token)
                .await
            {
                Ok(true) => {
                    tracing::info!(attempt_id = %started.attempt_id, "a claim whose handler was cut off was handed back: the attempt is queued again");
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(attempt_id = %started.attempt_id, error = %e, "a claim whose handler was cut off could not be handed back; the vanished sweep will find its attempt");
                }
            }
        })
    })
}
