//! Claiming: every delivery that got its slot while the previous claim
//! committed is moved `queued → started` by one guarded statement, which
//! commits before any request leaves.

use std::collections::{BTreeSet, HashMap};

use crate::domain::AttemptId;
use crate::provider::Client;
use crate::runtime::{Context, with_retries};
use crate::shutdown::Shutdown;
use crate::store::Started;

/// A claim's answer, or why the claim was not made.
pub(super) type Claimed = std::result::Result<ClaimAnswer, String>;

/// What a claim did with one attempt.
#[derive(Debug)]
pub(super) enum ClaimAnswer {
    /// Started: call its provider.
    Started(Started),
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
    crate::metrics::attempt_batch(&provider.name, "claim", ids.len());
    // One token for every try of this claim: a try whose commit took effect
    // unseen is found again by the next (Store::claim).
    let token = uuid::Uuid::now_v7();
    let claimed = with_retries(shutdown, "starting attempts", || async {
        Ok(ctx
            .store
            .claim(
                &provider.name,
                provider.evidence.kind.as_str(),
                &ids,
                provider.timeout,
                token,
            )
            .await?)
    })
    .await;
    match claimed {
        Ok(claim) => {
            let busy: BTreeSet<AttemptId> = claim.busy.into_iter().collect();
            let mut started: HashMap<AttemptId, Started> = claim
                .started
                .into_iter()
                .map(|s| (s.attempt_id, s))
                .collect();
            ids.iter()
                .map(|id| {
                    Ok(match started.remove(id) {
                        Some(s) => ClaimAnswer::Started(s),
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
                Ok(ctx.store.unclaim(token).await?)
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
