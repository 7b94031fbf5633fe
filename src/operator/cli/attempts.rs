//! `onejob attempts resolve`: settle an open attempt out of band, and publish
//! what the resolution caused.

use std::io::Write;
use std::sync::Arc;

use clap::{Subcommand, ValueEnum};
use serde_json::json;
use uuid::Uuid;

use super::{Connections, Failure, Outcome, publish_now, shown, store};
use crate::domain::{AttemptId, AttemptStatus};
use crate::edges::provider::Client;
use crate::edges::store::{Action, Actor, Refusal, Resolution, Settled};
use crate::settings::config::EvidenceKind;
use crate::shared::evidence::Looker;
use crate::shared::planner;

#[derive(Subcommand, Debug)]
pub(super) enum AttemptsCommand {
    /// Look up an unknown attempt's evidence at its provider now, and settle
    /// it by what is found, as the reconciler does by itself (a stored
    /// completion, or the answer to the same request sent again with the same
    /// key: a call the provider may bill). Recorded in the audit table with
    /// the reason before anything is asked; a resolution it finds is audited
    /// with the actor `evidence` too.
    Evidence {
        /// The attempt id.
        attempt_id: Uuid,
        /// Why, for the audit table (required: a look may be a billable
        /// re-send).
        #[arg(long)]
        reason: String,
    },
    /// Resolve an open (usually `unknown`) attempt. `failed` lets the route rule
    /// start the next attempt; `cancelled` ends the attempt and its job.
    Resolve {
        /// The attempt id.
        attempt_id: Uuid,
        /// How it ended.
        #[arg(long = "as", value_enum)]
        resolution: ResolveAs,
        /// Why, for the audit table (`jobs show` prints it).
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum ResolveAs {
    Failed,
    Cancelled,
}

/// `onejob attempts …`.
pub(super) async fn run(
    c: &Connections,
    command: AttemptsCommand,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    match command {
        AttemptsCommand::Evidence { attempt_id, reason } => {
            let actor = Actor::cli(Some(&reason));
            evidence(c, attempt_id, &actor, json, out).await
        }
        AttemptsCommand::Resolve {
            attempt_id,
            resolution,
            reason,
        } => {
            let actor = Actor::cli(reason.as_deref());
            resolve(c, attempt_id, resolution, &actor, json, out).await
        }
    }
}

/// How long a look asked for at the CLI holds its unknown from the pass.
const LOOK_LEASE: std::time::Duration = std::time::Duration::from_secs(60);

/// `onejob attempts resolve`.
async fn resolve(
    c: &Connections,
    attempt_id: Uuid,
    resolution: ResolveAs,
    actor: &Actor,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    let config = Arc::new(c.load_config()?);
    let store = store(c, &config).await?;
    let resolution = match resolution {
        ResolveAs::Failed => Resolution::Failed,
        ResolveAs::Cancelled => Resolution::Cancelled,
    };
    let jobs = store.jobs();
    let operation = match jobs.attempt_job(AttemptId(attempt_id)).await? {
        Some(job) => jobs
            .job(job)
            .await?
            .map(|j| j.operation)
            .unwrap_or_default(),
        None => return Err(Failure(format!("attempt {attempt_id} not found"))),
    };
    let planner = planner::load(&config, &store, [operation.as_str()]).await?;
    let plan = |f: &crate::policy::next::FailedJob| planner.plan(f);
    let (settled, publish) = match store
        .settle()
        .resolve(AttemptId(attempt_id), resolution, &plan, actor)
        .await?
    {
        Ok(r) => r,
        Err(refusal @ (Refusal::NotFound(_) | Refusal::Terminal(_))) => {
            return Err(Failure(refusal.to_string()));
        }
    };
    // Publish what the resolution caused now; if the broker is down, the
    // reconciler's relay publishes it once the lease is over.
    let published = match publish_now(c, &config, &store, &publish).await {
        Ok(()) => true,
        Err(e) => {
            eprintln!("onejob: warning: {e}; the reconciler will publish it");
            false
        }
    };
    let next = match settled {
        Settled::Failed { next, .. } => next,
        _ => None,
    };
    let job = match jobs.attempt_job(AttemptId(attempt_id)).await? {
        Some(j) => jobs.job(j).await?,
        None => return Err(Failure(format!("attempt {attempt_id} not found"))),
    };
    if json {
        writeln!(
            out,
            "{}",
            json!({
                "attempt_id": attempt_id,
                "resolved_as": match resolution { Resolution::Failed => "failed", Resolution::Cancelled => "cancelled" },
                "next_attempt": next,
                "published": published,
                "job": job,
            })
        )?;
    } else {
        let verb = match resolution {
            Resolution::Failed => "failed",
            Resolution::Cancelled => "cancelled",
        };
        writeln!(out, "attempt {attempt_id} resolved as {verb}")?;
        if let Some(n) = next {
            writeln!(out, "next attempt {n} queued")?;
        }
        if let Some(job) = job {
            writeln!(out, "job {} is now {}", job.id, job.status)?;
        }
    }
    Ok(())
}

/// `onejob attempts evidence`: one look now, audited first.
async fn evidence(
    c: &Connections,
    attempt_id: Uuid,
    actor: &Actor,
    json: bool,
    out: &mut impl Write,
) -> Outcome {
    if actor.reason.trim().is_empty() {
        return Err(Failure(
            "--reason may not be empty: a look may send a billable request again, and the audit table says why".into(),
        ));
    }
    let config = c.load_config()?;
    let store = store(c, &config).await?;
    let attempt = AttemptId(attempt_id);
    let (job, provider) = look_target(&config, &store, attempt).await?;
    let client = Client::new(provider.clone()).map_err(|e| Failure(e.to_string()))?;
    let action = Action {
        action: "attempt.evidence_look",
        job: Some(job),
        attempt: Some(attempt),
        target: Some(provider.name.clone()),
        detail: json!({ "evidence": provider.evidence.kind.as_str() }),
        ..Action::default()
    };
    // Recorded before the look: a look may send the request again.
    let audit = store.audit().begin(actor, &action).await?;
    let Some(unknown) = store.evidence().evidence_now(attempt, LOOK_LEASE).await? else {
        let why = format!("attempt {attempt_id} is no longer unknown");
        let _ = store
            .audit()
            .outcome(audit, true, &json!({ "error": why }))
            .await;
        return Err(Failure(why));
    };
    let looker = Looker {
        store: &store,
        config: &config,
    };
    let look = match looker.look(&client, &unknown).await {
        Ok(look) => look,
        Err(e) => {
            let detail = json!({ "error": e.to_string() });
            let _ = store.audit().outcome(audit, true, &detail).await;
            return Err(e.into());
        }
    };
    let detail = json!({ "found": look.found, "settled": look.settled });
    if let Err(e) = store.audit().outcome(audit, false, &detail).await {
        eprintln!(
            "onejob: warning: the outcome was not written to audit row {audit} (it stays pending): {e}"
        );
    }
    let published = publish_now(c, &config, &store, &look.publish).await;
    if let Err(e) = &published {
        eprintln!("onejob: warning: {e}; the reconciler will publish it");
    }
    if json {
        writeln!(
            out,
            "{}",
            json!({ "attempt_id": attempt_id, "found": look.found, "settled": look.settled,
                    "published": published.is_ok() })
        )?;
    } else {
        writeln!(out, "attempt {attempt_id}: {}", shown(&look.found))?;
        if let Some(settled) = &look.settled {
            writeln!(out, "settled: {settled}")?;
        }
    }
    Ok(())
}

/// The job and provider of `attempt`, which an operator's look may look up:
/// it is `unknown`, and its provider keeps evidence that is not off.
async fn look_target(
    config: &crate::settings::config::Config,
    store: &crate::edges::store::Store,
    attempt: AttemptId,
) -> Result<(crate::domain::JobId, crate::settings::config::Provider), Failure> {
    let attempt_id = attempt.0;
    let job = match store.jobs().attempt_job(attempt).await? {
        Some(job) => store.jobs().job(job).await?,
        None => None,
    };
    let a = job
        .iter()
        .flat_map(|j| &j.attempts)
        .find(|a| a.id == attempt)
        .ok_or_else(|| Failure(format!("attempt {attempt_id} not found")))?;
    if a.status != AttemptStatus::Unknown {
        return Err(Failure(format!(
            "attempt {attempt_id} is {}, not unknown: there is no evidence to look up",
            a.status
        )));
    }
    let provider = config.providers.get(&a.provider).cloned().ok_or_else(|| {
        Failure(format!(
            "attempt {attempt_id}'s provider {:?} is not configured",
            a.provider
        ))
    })?;
    if provider.evidence.kind == EvidenceKind::None {
        return Err(Failure(format!(
            "provider {} keeps no evidence (evidence = \"none\"): resolve the attempt with `onejob attempts resolve`",
            provider.name
        )));
    }
    if let Some(claim) = store.evidence().latest_claims().await?.get(&provider.name)
        && !crate::shared::evidence::claim_holds(&provider, Some(claim))
    {
        return Err(Failure(format!(
            "evidence is off for provider {}: its qualification on {} found the claim false ({}); resolve the attempt with `onejob attempts resolve`, or qualify the provider again",
            provider.name,
            claim.checked_at.format("%Y-%m-%d %H:%M:%S UTC"),
            claim.detail
        )));
    }
    Ok((a.job_id, provider))
}
