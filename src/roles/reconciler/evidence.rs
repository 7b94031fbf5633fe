//! The evidence pass: every second, the `unknown` attempts of providers that
//! keep evidence and are due for a look are taken (one pod at a time, under a
//! lease) and looked up ([`crate::evidence`]), and what their resolutions
//! wrote is published.

use std::collections::HashMap;
use std::time::Duration;

use crate::config::EvidenceKind;
use crate::evidence::Looker;
use crate::provider::Client;
use crate::runtime::{Context, Result};
use crate::shutdown::Shutdown;

/// How long a pod holds an unknown it is looking up before another may, on
/// top of its provider's `timeout`.
const LEASE: Duration = Duration::from_secs(60);
/// Unknowns one pass looks up at most.
const BATCH: i64 = 32;
/// How often the pass runs.
const EVERY: Duration = Duration::from_secs(1);

/// Runs the pass every [`EVERY`] until shutdown, in a loop of its own: looks
/// wait on providers, and must never hold up the other passes.
pub(crate) async fn evidence_loop(ctx: Context, shutdown: Shutdown) {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.wait() => return,
            _ = tick.tick() => {}
        }
        if let Err(e) = evidence_once(&ctx).await {
            tracing::warn!(error = %e, "evidence pass failed; will retry");
        }
    }
}

/// One pass: the due unknowns of every provider that keeps evidence, unless
/// its latest qualification found the claim false (then an operator resolves
/// them, until a later qualification finds it holds). Each is taken under its
/// own lease just before its look, one at a time, so that a lease never runs
/// out while a slow look before it is still going; [`BATCH`] looks at most.
pub(crate) async fn evidence_once(ctx: &Context) -> Result<()> {
    let keeping = ctx
        .config
        .providers
        .values()
        .filter(|p| p.evidence.kind != EvidenceKind::None);
    // Without such a provider (the default), the pass asks the database nothing.
    if keeping.clone().next().is_none() {
        return Ok(());
    }
    let claims = ctx.store.latest_claims().await?;
    let providers: Vec<&crate::config::Provider> = keeping
        .filter(|p| crate::evidence::claim_holds(p, claims.get(&p.name)))
        .collect();
    if providers.is_empty() {
        return Ok(());
    }
    let delays: Vec<(String, Duration)> = providers
        .iter()
        .map(|p| (p.name.clone(), p.evidence.delay))
        .collect();
    // Longer than the slowest look: a re-send waits up to its provider's timeout.
    let slowest = providers
        .iter()
        .map(|p| p.timeout)
        .max()
        .unwrap_or_default();
    let lease = LEASE + slowest;
    let looker = Looker {
        store: &ctx.store,
        config: &ctx.config,
    };
    let mut clients: HashMap<String, Client> = HashMap::new();
    for _ in 0..BATCH {
        let Some(unknown) = ctx.store.evidence_due(&delays, lease, 1).await?.pop() else {
            break;
        };
        let Some(provider) = ctx.config.providers.get(&unknown.provider) else {
            continue;
        };
        if !clients.contains_key(&provider.name) {
            match Client::new(provider.clone()) {
                Ok(c) => {
                    clients.insert(provider.name.clone(), c);
                }
                Err(e) => {
                    tracing::warn!(provider = %provider.name, error = %e, "evidence: no client");
                    continue;
                }
            }
        }
        let look = looker.look(&clients[&provider.name], &unknown).await?;
        ctx.publish_outbox(&look.publish).await?;
    }
    Ok(())
}
