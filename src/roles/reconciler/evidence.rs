//! The evidence pass: every second, for each provider that keeps evidence
//! apart, its `unknown` attempts that are due for a look are taken (one pod
//! at a time, under a lease) and looked up ([`crate::shared::evidence`]), and what
//! their resolutions wrote is published.

use std::time::Duration;

use crate::edges::provider::Client;
use crate::edges::shutdown::Shutdown;
use crate::settings::config::{Config, EvidenceKind};
use crate::shared::evidence::Looker;
use crate::shared::runtime::{Context, Result};

use super::pass::Pass;

/// How long a pod holds an unknown it is looking up before another may, on
/// top of its provider's `timeout`.
const LEASE: Duration = Duration::from_secs(60);
/// Unknowns one pass looks up at most, per provider.
const BATCH: i64 = 32;
/// How often the pass runs.
const EVERY: Duration = Duration::from_secs(1);

/// One provider's evidence pass, every second: a pass per provider that
/// keeps evidence, apart from the other passes and from each other, since a
/// look can wait a whole timeout (a re-send, a listing that does not
/// answer), and one slow provider must hold up neither the other passes nor
/// the looks of the other providers.
pub struct Evidence {
    client: Client,
}

impl Evidence {
    /// The passes for the providers of `config` that keep evidence: none by
    /// default, so that the pass then asks the database nothing. A provider
    /// whose client cannot be made is left out with a warning (its unknowns
    /// wait for an operator).
    pub fn passes(config: &Config) -> Vec<Evidence> {
        config
            .providers
            .values()
            .filter(|p| p.evidence.kind != EvidenceKind::None)
            .filter_map(|p| match Client::new(p.clone()) {
                Ok(client) => Some(Evidence { client }),
                Err(e) => {
                    tracing::warn!(provider = %p.name, error = %e, "evidence: no client; its unknowns wait for an operator");
                    None
                }
            })
            .collect()
    }
}

impl Pass for Evidence {
    fn name(&self) -> &'static str {
        "evidence"
    }

    fn subject(&self) -> Option<&str> {
        Some(&self.client.provider().name)
    }

    fn every(&self, _: &Config) -> Duration {
        EVERY
    }

    /// One look at the provider's due unknowns, cut short at a shutdown.
    /// Returns the unknowns looked at.
    async fn once(&self, ctx: &Context, shutdown: &Shutdown) -> Result<u64> {
        tokio::select! {
            () = shutdown.wait() => Ok(0),
            looked = provider_once(ctx, &self.client) => looked,
        }
    }
}

/// One pass over one provider's due unknowns, unless its latest
/// qualification found its claim false (then an operator resolves them,
/// until a later qualification finds it holds). Each is taken under its own
/// lease just before its look, one at a time, so that a lease never runs out
/// while a slow look before it is still going; [`BATCH`] looks at most.
async fn provider_once(ctx: &Context, client: &Client) -> Result<u64> {
    let provider = client.provider();
    let claims = ctx.store.evidence().latest_claims().await?;
    if !crate::shared::evidence::claim_holds(provider, claims.get(&provider.name)) {
        return Ok(0);
    }
    let delays = [(provider.name.clone(), provider.evidence.delay)];
    // Longer than the slowest look: a re-send waits up to the provider's timeout.
    let lease = LEASE + provider.timeout;
    let looker = Looker {
        store: &ctx.store,
        config: &ctx.config,
    };
    let mut looked = 0;
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
        looked += 1;
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
    Ok(looked)
}
