//! The evidence pass (contract section 7, Evidence): each `unknown` attempt of
//! a provider whose evidence is `stored` is looked up at the provider, one pod
//! at a time under a lease, no sooner than `evidence_delay` after its call's
//! deadline and then with a growing pause. A stored completion that names the
//! attempt and its job is the attempt's answer: judged as a live answer and
//! settled by the same compare-and-swap (a job that ended meanwhile discards
//! it, its usage kept). None by `evidence_deadline` after the call started:
//! the attempt fails (`no_evidence`) and the route moves on. A provider that
//! cannot be asked is asked again later. No row is locked during a look, and
//! every resolution is audited with the actor `evidence`.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;

use crate::config::EvidenceKind;
use crate::policy::Planner;
use crate::provider::{Client, verdict};
use crate::runtime::{Context, Result};
use crate::shutdown::Shutdown;
use crate::store::{Action, Actor, EvidenceDue, FailedJob, Finished, Verdict};

/// How long a pod holds an unknown it is looking up before another may.
const LEASE: Duration = Duration::from_secs(60);
/// Unknowns one pass looks up at most.
const BATCH: i64 = 32;
/// The longest pause between two looks at one unknown.
const MAX_PAUSE: Duration = Duration::from_secs(60);
/// How often the pass runs.
const EVERY: Duration = Duration::from_secs(1);
/// The longest one look may take: a provider that does not answer in time
/// is asked again later.
const LOOK_TIMEOUT: Duration = Duration::from_secs(10);

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

/// One pass: the due unknowns of every provider with stored evidence.
pub(crate) async fn evidence_once(ctx: &Context) -> Result<()> {
    let providers: Vec<(String, Duration)> = ctx
        .config
        .providers
        .values()
        .filter(|p| p.evidence.kind == EvidenceKind::Stored)
        .map(|p| (p.name.clone(), p.evidence.delay))
        .collect();
    if providers.is_empty() {
        return Ok(());
    }
    let due = ctx.store.evidence_due(&providers, LEASE, BATCH).await?;
    let mut clients: HashMap<String, Client> = HashMap::new();
    for unknown in due {
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
        look(ctx, &clients[&provider.name], &unknown).await?;
    }
    Ok(())
}

/// Looks `unknown` up once, and settles it, fails it, or notes when to look
/// again.
async fn look(ctx: &Context, client: &Client, unknown: &EvidenceDue) -> Result<()> {
    let evidence = client.provider().evidence;
    let found = tokio::time::timeout(
        LOOK_TIMEOUT,
        client.stored(unknown.attempt_id, unknown.job_id),
    )
    .await
    .unwrap_or_else(|_| Err(format!("no answer within {} s", LOOK_TIMEOUT.as_secs())));
    let past_deadline = chrono::Utc::now()
        > unknown.started_at
            + chrono::Duration::from_std(evidence.deadline).unwrap_or(chrono::Duration::MAX);
    match found {
        Ok(Some(answer)) => settle(ctx, unknown, answer).await,
        Ok(None) if past_deadline => {
            let error = format!(
                "no_evidence: the provider stored no completion of this attempt within evidence_deadline ({})",
                humantime::format_duration(evidence.deadline)
            );
            resolve(ctx, unknown, failed(unknown, error), "not found").await
        }
        Ok(None) => {
            let note = "nothing stored yet";
            Ok(ctx
                .store
                .note_evidence(
                    unknown.attempt_id,
                    note,
                    pause(evidence.delay, unknown.looks),
                )
                .await?)
        }
        Err(e) => {
            tracing::warn!(attempt_id = %unknown.attempt_id, error = %e, "evidence: the provider could not be asked; looking again later");
            let note = format!("the provider could not be asked: {e}");
            Ok(ctx
                .store
                .note_evidence(
                    unknown.attempt_id,
                    &note,
                    pause(evidence.delay, unknown.looks),
                )
                .await?)
        }
    }
}

/// The pause before the next look: the delay, doubled with each look, at
/// most [`MAX_PAUSE`].
fn pause(delay: Duration, looks: i32) -> Duration {
    let doublings = u32::try_from(looks.clamp(1, 16) - 1).unwrap_or(0);
    delay.saturating_mul(1 << doublings).min(MAX_PAUSE)
}

/// The found answer, judged as a live one, settled.
async fn settle(
    ctx: &Context,
    unknown: &EvidenceDue,
    answer: std::result::Result<crate::provider::Answer, crate::provider::CallError>,
) -> Result<()> {
    let mut finished = failed(unknown, String::new());
    let Some(operation) = ctx.config.operations.get(&unknown.operation) else {
        return Ok(());
    };
    finished.verdict = verdict(operation, answer, &mut finished);
    resolve(ctx, unknown, finished, "found").await
}

/// A finished attempt for `unknown` with a definite failure `error`.
fn failed(unknown: &EvidenceDue, error: String) -> Finished {
    Finished {
        attempt_id: unknown.attempt_id,
        job_id: unknown.job_id,
        version: unknown.version,
        provider_request_id: None,
        usage: None,
        verdict: Verdict::Failed {
            error,
            retryable: true,
            retry_after: None,
        },
    }
}

/// Records the resolution first (actor `evidence`), then settles it by the
/// same settlement as a live answer, and publishes what it caused.
async fn resolve(
    ctx: &Context,
    unknown: &EvidenceDue,
    finished: Finished,
    what: &str,
) -> Result<()> {
    let action = Action {
        action: "attempt.evidence",
        job: Some(unknown.job_id),
        attempt: Some(unknown.attempt_id),
        target: Some(unknown.provider.clone()),
        detail: json!({
            "evidence": what,
            "request_id": finished.provider_request_id,
            "verdict": match &finished.verdict {
                Verdict::Succeeded(_) => "succeeded".to_owned(),
                Verdict::Failed { error, .. } => error.clone(),
                Verdict::Unknown { error } => error.clone(),
            },
        }),
        ..Action::default()
    };
    let audit = ctx.store.audit_begin(&Actor::evidence(), &action).await?;
    let planner = Planner::load_all(&ctx.config, &ctx.store).await?;
    let plan = |f: &FailedJob| planner.plan(f);
    let (settled, publish) = ctx
        .store
        .finalize(std::slice::from_ref(&finished), &plan)
        .await?;
    let settled = settled
        .first()
        .map(|s| format!("{s:?}"))
        .unwrap_or_default();
    tracing::info!(attempt_id = %unknown.attempt_id, job_id = %unknown.job_id, evidence = what, %settled, "evidence: an unknown attempt was settled");
    if let Err(e) = ctx
        .store
        .audit_outcome(audit, false, &json!({ "settled": settled }))
        .await
    {
        tracing::warn!(error = %e, %audit, "evidence: the outcome was not written to its audit row");
    }
    ctx.publish_outbox(&publish).await?;
    Ok(())
}
