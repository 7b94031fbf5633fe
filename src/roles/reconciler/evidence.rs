//! The evidence pass (contract section 7, Evidence): each `unknown` attempt of
//! a provider that keeps evidence is looked up at the provider, one pod at a
//! time under a lease, no sooner than `evidence_delay` after its call's
//! deadline and then with a growing pause. No row is locked during a look,
//! and every resolution is audited with the actor `evidence`.
//!
//! - `stored`: a stored completion that names the attempt and its job is the
//!   attempt's answer, judged as a live answer and settled by the same
//!   compare-and-swap (a job that ended meanwhile discards it, its usage
//!   kept). None by `evidence_deadline` after the call started: the attempt
//!   fails (`no_evidence`) and the route moves on. A provider that cannot be
//!   asked is asked again later.
//! - `idempotency_key`: the identical request is sent again with the same
//!   key; the provider answers with the first one's outcome, so the work runs
//!   at most once, and that answer settles the attempt. A `409` (the first
//!   request did not complete) is a definite failure. A re-send that is itself
//!   unknown is tried again until `evidence_deadline`; then the attempt waits
//!   for an operator.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;

use crate::config::EvidenceKind;
use crate::policy::Planner;
use crate::provider::{CallError, Client, verdict};
use crate::runtime::{Context, Result};
use crate::shutdown::Shutdown;
use crate::store::{Action, Actor, EvidenceDue, FailedJob, Finished, Verdict};

/// How long a pod holds an unknown it is looking up before another may.
const LEASE: Duration = Duration::from_secs(60);
/// Unknowns one pass looks up at most.
const BATCH: i64 = 32;
/// The longest pause between two looks at one unknown.
const MAX_PAUSE: Duration = Duration::from_secs(60);
/// The pause of an unknown that waits for an operator: no more looks.
const NEVER: Duration = Duration::from_secs(100 * 366 * 24 * 3600);
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
        .filter(|p| p.evidence.kind != EvidenceKind::None)
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

/// Looks `unknown` up once, as its provider's evidence allows.
async fn look(ctx: &Context, client: &Client, unknown: &EvidenceDue) -> Result<()> {
    match client.provider().evidence.kind {
        EvidenceKind::Stored => look_stored(ctx, client, unknown).await,
        EvidenceKind::IdempotencyKey => send_again(ctx, client, unknown).await,
        EvidenceKind::None => Ok(()),
    }
}

/// Whether `unknown`'s evidence deadline has passed.
fn past_deadline(client: &Client, unknown: &EvidenceDue) -> bool {
    let deadline = client.provider().evidence.deadline;
    chrono::Utc::now()
        > unknown.started_at + chrono::Duration::from_std(deadline).unwrap_or(chrono::Duration::MAX)
}

/// Sends `unknown`'s request again with its key, and settles it by the
/// answer, fails it on a `409`, or notes when to send again (or, past the
/// deadline, that it waits for an operator).
async fn send_again(ctx: &Context, client: &Client, unknown: &EvidenceDue) -> Result<()> {
    let evidence = client.provider().evidence;
    let (Some(operation), Some(input)) = (
        ctx.config.operations.get(&unknown.operation),
        unknown.input.as_object(),
    ) else {
        return Ok(());
    };
    let answer = match ctx.config.render(operation, input) {
        Ok(rendered) => {
            client
                .complete(
                    unknown.attempt_id,
                    Some(unknown.job_id),
                    operation,
                    &rendered,
                )
                .await
        }
        Err(e) => Err(CallError::Refused(e.to_string())),
    };
    match answer {
        Ok(answer) => settle(ctx, unknown, Ok(answer), "replayed").await,
        Err(CallError::Rejected { message, .. }) if message.starts_with("HTTP 409") => {
            let error = format!(
                "not_completed: the provider says the first request with this attempt's key did not complete: {message}"
            );
            resolve(ctx, unknown, failed(unknown, error), "not completed").await
        }
        Err(e) if past_deadline(client, unknown) => {
            let note = format!(
                "sent again until evidence_deadline, with no answer ({e}): waits for an operator"
            );
            Ok(ctx
                .store
                .note_evidence(unknown.attempt_id, &note, NEVER)
                .await?)
        }
        Err(e) => {
            let note = format!("sent again, no answer yet: {e}");
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

/// Looks for `unknown`'s stored completion, and settles it by what it finds,
/// fails it past the deadline, or notes when to look again.
async fn look_stored(ctx: &Context, client: &Client, unknown: &EvidenceDue) -> Result<()> {
    let evidence = client.provider().evidence;
    let found = tokio::time::timeout(
        LOOK_TIMEOUT,
        client.stored(unknown.attempt_id, unknown.job_id),
    )
    .await
    .unwrap_or_else(|_| Err(format!("no answer within {} s", LOOK_TIMEOUT.as_secs())));
    let past_deadline = past_deadline(client, unknown);
    match found {
        Ok(Some(answer)) => settle(ctx, unknown, answer, "found").await,
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

/// The answer found (`what`: how), judged as a live one, settled.
async fn settle(
    ctx: &Context,
    unknown: &EvidenceDue,
    answer: std::result::Result<crate::provider::Answer, CallError>,
    what: &str,
) -> Result<()> {
    let mut finished = failed(unknown, String::new());
    let Some(operation) = ctx.config.operations.get(&unknown.operation) else {
        return Ok(());
    };
    finished.verdict = verdict(operation, answer, &mut finished);
    resolve(ctx, unknown, finished, what).await
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
