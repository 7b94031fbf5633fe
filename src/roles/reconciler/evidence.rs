//! The evidence pass: every second, for each provider that keeps evidence
//! apart, its `unknown` attempts that are due for a look are taken (one pod
//! at a time, under a lease) and looked up ([`crate::shared::evidence`]), and what
//! their resolutions wrote is published.

use std::time::Duration;

use crate::edges::provider::Client;
use crate::edges::shutdown::Shutdown;
use crate::settings::config::{EvidenceKind, Provider};
use crate::shared::evidence::Looker;
use crate::shared::runtime::{Context, Result};

/// How long a pod holds an unknown it is looking up before another may, on
/// top of its provider's `timeout`.
const LEASE: Duration = Duration::from_secs(60);
/// Unknowns one pass looks up at most, per provider.
const BATCH: i64 = 32;
/// How often the pass runs.
const EVERY: Duration = Duration::from_secs(1);

/// Runs the pass until shutdown: one loop per provider that keeps evidence,
/// each every [`EVERY`], apart from the other passes and from each other: a
/// look can wait a whole timeout (a re-send, a listing that does not
/// answer), and one slow provider must hold up neither the other passes nor
/// the looks of the other providers.
pub(super) async fn evidence_loop(ctx: Context, shutdown: Shutdown) {
    let loops: Vec<_> = ctx
        .config
        .providers
        .values()
        .filter(|p| p.evidence.kind != EvidenceKind::None)
        .map(|p| provider_loop(ctx.clone(), p.clone(), shutdown.clone()))
        .collect();
    // Without such a provider (the default), the pass asks the database nothing.
    futures_util::future::join_all(loops).await;
}

/// One provider's looks, every [`EVERY`] until shutdown.
async fn provider_loop(ctx: Context, provider: Provider, shutdown: Shutdown) {
    let client = match Client::new(provider.clone()) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(provider = %provider.name, error = %e, "evidence: no client; its unknowns wait for an operator");
            return;
        }
    };
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.wait() => return,
            _ = tick.tick() => {}
        }
        let pass = provider_once(&ctx, &client);
        let outcome = tokio::select! {
            () = shutdown.wait() => return,
            outcome = pass => outcome,
        };
        if let Err(e) = outcome {
            tracing::warn!(provider = %provider.name, error = %e, "evidence pass failed; will retry");
        }
    }
}

/// One pass over one provider's due unknowns, unless its latest
/// qualification found its claim false (then an operator resolves them,
/// until a later qualification finds it holds). Each is taken under its own
/// lease just before its look, one at a time, so that a lease never runs out
/// while a slow look before it is still going; [`BATCH`] looks at most.
async fn provider_once(ctx: &Context, client: &Client) -> Result<()> {
    let provider = client.provider();
    let claims = ctx.store.evidence().latest_claims().await?;
    if !crate::shared::evidence::claim_holds(provider, claims.get(&provider.name)) {
        return Ok(());
    }
    let delays = [(provider.name.clone(), provider.evidence.delay)];
    // Longer than the slowest look: a re-send waits up to the provider's timeout.
    let lease = LEASE + provider.timeout;
    let looker = Looker {
        store: &ctx.store,
        config: &ctx.config,
    };
    for _ in 0..BATCH {
        let Some(unknown) = ctx
            .store
            .evidence()
            .evidence_due(&delays, lease, 1)
            .await?
            .pop()
        else {
            break;
        };
        let look = match looker.look(client, &unknown).await {
            Ok(look) => look,
            Err(e) => {
                // Its lease would keep it from every look for a minute and
                // more: a look that failed (Postgres, say) is due again soon.
                tracing::warn!(attempt_id = %unknown.attempt_id, error = %e, "evidence: a look failed; looking again shortly");
                let note = format!("the look failed ({e}); looking again shortly");
                let again = provider.evidence.delay.max(Duration::from_secs(1));
                ctx.store
                    .evidence()
                    .note_evidence(unknown.attempt_id, &note, Some(again))
                    .await?;
                continue;
            }
        };
        ctx.publish_outbox(&look.publish).await?;
    }
    Ok(())
}
