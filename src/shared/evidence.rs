//! One look at an `unknown` attempt's evidence (contract section 7,
//! Evidence), as the reconciler's pass takes it and as an operator asks for it
//! (`onejob attempts evidence`). No row is locked during a look, and every
//! resolution is audited with the actor `evidence` before it is settled.
//!
//! Evidence is read only from a call that asked for it: each attempt records
//! what its call could leave (`attempts.evidence`). An unknown whose call
//! asked for another kind (made before the provider's evidence was switched
//! on, or changed) waits for an operator: nothing is concluded from silence
//! it never asked to be broken, and nothing is sent again that carried no key.
//!
//! What a look finds is never stranded: a found answer (or the failure it
//! concludes) is kept on its attempt first, then settled by the same
//! settlement as a live answer, which clears it in its own transaction. A
//! settlement that meets a held row, an error or a crash leaves the answer
//! kept, and the kept-answer pass settles it later; the attempt is not looked
//! at again meanwhile.
//!
//! An attempt discarded while still unknown (another attempt won) is looked
//! up too, for what its call cost, from stored completions only: what is
//! found is kept on it, and it stays discarded. It is never sent again: a
//! re-send could buy new work for a job that is over.
//!
//! - `stored`: a stored completion that names the attempt and its job is the
//!   attempt's answer, judged as a live answer and settled by the same
//!   compare-and-swap (a job that ended meanwhile discards it, its usage
//!   kept). The listing is read to its end, every page. None by
//!   `evidence_deadline` after the call started: the attempt fails
//!   (`no_evidence`) and the route moves on. A provider that cannot be asked
//!   (or whose listing cannot be read to its end) is asked again later.
//! - `idempotency_key`: the identical request is sent again with the same
//!   key; the provider answers with the first one's outcome, so the work runs
//!   at most once, and that answer settles the attempt. A `409` means the
//!   first request is still being processed: look again later. A re-send
//!   that is itself unknown, or a `409`, is tried again until
//!   `evidence_deadline`; then the attempt waits for an operator.

use crate::policy::next::FailedJob;
use std::time::Duration;

use serde::Serialize;
use serde_json::json;

use crate::domain::AttemptStatus;
use crate::edges::provider::Client;
use crate::edges::provider::answer::{Answer, CallError, verdict};
use crate::edges::store::{
    Action, Actor, EvidenceClaim, EvidenceDue, Finished, OutboxMessage, Settled, Store, Verdict,
};
use crate::settings::config::{Config, EvidenceKind, Provider};
use crate::shared::planner;
use crate::shared::runtime::Result;

/// The longest pause between two looks at one unknown.
const MAX_PAUSE: Duration = Duration::from_secs(60);
/// The longest one look at stored completions may take: a provider that does
/// not answer in time is asked again later.
const LOOK_TIMEOUT: Duration = Duration::from_secs(10);
/// What one look came to.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Look {
    /// What it found, in words (also kept on the attempt).
    pub(crate) found: String,
    /// How the attempt was settled, when the look resolved it.
    pub(crate) settled: Option<String>,
    /// The look's outcome, for the metrics ([`crate::edges::metrics::evidence_look`]).
    #[serde(skip)]
    pub(crate) outcome: &'static str,
    /// The outbox rows the resolution wrote, to publish now.
    #[serde(skip)]
    pub(crate) publish: Vec<OutboxMessage>,
}

/// Where a look runs.
pub(crate) struct Looker<'a> {
    /// The store.
    pub(crate) store: &'a Store,
    /// The configuration.
    pub(crate) config: &'a Config,
}

impl Looker<'_> {
    /// Looks `unknown` up once, as its provider's evidence allows, and
    /// counts what came of it.
    pub(crate) async fn look(&self, client: &Client, unknown: &EvidenceDue) -> Result<Look> {
        let kind = client.provider().evidence.kind;
        let look = match kind {
            EvidenceKind::None => Look {
                found: "the provider keeps no evidence: an operator resolves it".into(),
                outcome: "waits_for_operator",
                ..Look::default()
            },
            _ if unknown.asked.as_deref() != Some(kind.as_str()) => {
                let asked = unknown
                    .asked
                    .as_deref()
                    .unwrap_or("none (made before onejob recorded it)");
                let found = format!(
                    "its call asked for no {} evidence (it asked for {asked}): nothing can be concluded from the provider, an operator resolves it",
                    kind.as_str()
                );
                self.note_final(unknown, found, "not_asked").await?
            }
            EvidenceKind::Stored => self.look_stored(client, unknown).await?,
            EvidenceKind::IdempotencyKey if unknown.discarded => {
                let found = "discarded while unknown: never sent again (a re-send could buy new work for a job that is over); its cost is not known".into();
                self.note_final(unknown, found, "no_evidence").await?
            }
            EvidenceKind::IdempotencyKey => self.send_again(client, unknown).await?,
        };
        let provider = client.provider();
        crate::edges::metrics::evidence_look(&provider.name, look.outcome);
        // A discarded attempt's look finds what it cost; it resolves nothing.
        if look.settled.is_some() && !unknown.discarded {
            let unknown_since = unknown.started_at
                + chrono::Duration::from_std(provider.timeout).unwrap_or_default();
            let unknown_for = (chrono::Utc::now() - unknown_since)
                .to_std()
                .unwrap_or_default();
            crate::edges::metrics::unknown_resolved(look.outcome, unknown_for);
        }
        Ok(look)
    }

    /// Looks for `unknown`'s stored completion, and settles it by what it
    /// finds, fails it past the deadline, or notes when to look again.
    async fn look_stored(&self, client: &Client, unknown: &EvidenceDue) -> Result<Look> {
        let found = tokio::time::timeout(
            LOOK_TIMEOUT,
            client.stored(unknown.attempt_id, Some(unknown.job_id)),
        )
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} s", LOOK_TIMEOUT.as_secs())));
        match found {
            Ok(Some(answer)) if unknown.discarded => self.record_cost(unknown, answer).await,
            Ok(Some(answer)) => self.settle(unknown, answer, ("found", "stored")).await,
            Ok(None) if past_deadline(client, unknown) && unknown.discarded => {
                let found = "nothing stored by evidence_deadline: its cost is not known".into();
                self.note_final(unknown, found, "no_evidence").await
            }
            Ok(None) if past_deadline(client, unknown) => {
                let error = format!(
                    "no_evidence: the provider stored no completion of this attempt within evidence_deadline ({})",
                    humantime::format_duration(client.provider().evidence.deadline)
                );
                let how = ("not found", "no_evidence");
                self.resolve(unknown, failed(unknown, error), how).await
            }
            Ok(None) => {
                let found = "nothing stored yet".into();
                self.note(client, unknown, found, "nothing_yet").await
            }
            Err(e) => {
                tracing::warn!(attempt_id = %unknown.attempt_id, error = %e, "evidence: the provider could not be asked; looking again later");
                let note = format!("the provider could not be asked: {e}");
                self.note(client, unknown, note, "unreachable").await
            }
        }
    }

    /// Sends `unknown`'s request again with its key, and settles it by the
    /// answer, or notes when to send again (a `409`: the first request is
    /// still being processed; or no answer), or, past the deadline, that it
    /// waits for an operator.
    async fn send_again(&self, client: &Client, unknown: &EvidenceDue) -> Result<Look> {
        let (Some(operation), Some(input)) = (
            self.config.operations.get(&unknown.operation),
            unknown.input.as_object(),
        ) else {
            return Ok(Look::default());
        };
        // Read again just before sending: an attempt discarded since it was
        // taken for this look (its job ended) is never sent again.
        let state = self.store.jobs().attempt_state(unknown.attempt_id).await?;
        if !matches!(state, Some((_, AttemptStatus::Unknown, _))) {
            let found = "no longer unknown when its look came: never sent again (a re-send could buy new work for a job that is over)".into();
            return self.note_final(unknown, found, "no_evidence").await;
        }
        let answer = match self.config.render(operation, input) {
            Ok(rendered) => {
                let job = Some(unknown.job_id);
                client
                    .complete(unknown.attempt_id, job, None, operation, &rendered)
                    .await
            }
            Err(e) => Err(CallError::Refused(e.to_string())),
        };
        match answer {
            Ok(answer) => {
                self.settle(unknown, Ok(answer), ("replayed", "replayed"))
                    .await
            }
            Err(CallError::Rejected { message, .. })
                if message.starts_with("HTTP 409") && !past_deadline(client, unknown) =>
            {
                let note = format!(
                    "the provider is still processing the first request with this key; looking again later: {message}"
                );
                self.note(client, unknown, note, "in_progress").await
            }
            Err(e) if past_deadline(client, unknown) => {
                let found = format!(
                    "sent again until evidence_deadline, with no answer ({e}): waits for an operator"
                );
                self.note_final(unknown, found, "waits_for_operator").await
            }
            Err(e) => {
                let note = format!("sent again, no answer yet: {e}");
                self.note(client, unknown, note, "unreachable").await
            }
        }
    }

    /// Keeps what a look found, and when the next may come.
    async fn note(
        &self,
        client: &Client,
        unknown: &EvidenceDue,
        found: String,
        outcome: &'static str,
    ) -> Result<Look> {
        let next = pause(client.provider().evidence.delay, unknown.looks);
        self.store
            .evidence()
            .note_evidence(unknown.attempt_id, &found, Some(next))
            .await?;
        Ok(Look {
            found,
            outcome,
            ..Look::default()
        })
    }

    /// Keeps what a discarded attempt's stored completion says it cost (its
    /// usage, whatever its content: a paid answer that breaks the output
    /// contract was paid for too), with what was found, in one statement.
    async fn record_cost(
        &self,
        unknown: &EvidenceDue,
        answer: std::result::Result<Answer, CallError>,
    ) -> Result<Look> {
        let (usage, request_id) = match &answer {
            Ok(a) => (a.usage.clone(), a.request_id.clone()),
            Err(CallError::Rejected { usage, .. }) => (usage.clone(), None),
            Err(_) => (None, None),
        };
        let found = match &usage {
            Some(usage) => format!("cost found: {usage}"),
            None => "cost found: the stored completion reports no usage".to_owned(),
        };
        let action = Action {
            action: "attempt.evidence",
            job: Some(unknown.job_id),
            attempt: Some(unknown.attempt_id),
            target: Some(unknown.provider.clone()),
            detail: json!({ "evidence": "cost found", "request_id": request_id, "usage": usage }),
            ..Action::default()
        };
        let audit_rows = self.store.audit();
        let audit = audit_rows.begin(&Actor::evidence(), &action).await?;
        self.store
            .evidence()
            .record_cost(
                unknown.attempt_id,
                usage.as_ref(),
                request_id.as_deref(),
                &found,
            )
            .await?;
        if let Err(e) = self.store.audit().outcome(audit, false, &json!({})).await {
            tracing::warn!(error = %e, %audit, "evidence: the outcome was not written to its audit row");
        }
        Ok(Look {
            found,
            outcome: "cost_found",
            ..Look::default()
        })
    }

    /// Keeps what the last look found: no more looks.
    async fn note_final(
        &self,
        unknown: &EvidenceDue,
        found: String,
        outcome: &'static str,
    ) -> Result<Look> {
        self.store
            .evidence()
            .note_evidence(unknown.attempt_id, &found, None)
            .await?;
        Ok(Look {
            found,
            outcome,
            ..Look::default()
        })
    }

    /// The answer found (`how`: in words, and as the metrics name it), judged
    /// as a live one, settled.
    async fn settle(
        &self,
        unknown: &EvidenceDue,
        answer: std::result::Result<Answer, CallError>,
        how: (&str, &'static str),
    ) -> Result<Look> {
        let mut finished = failed(unknown, String::new());
        let Some(operation) = self.config.operations.get(&unknown.operation) else {
            return Ok(Look::default());
        };
        finished.verdict = verdict(operation, answer, &mut finished);
        self.resolve(unknown, finished, how).await
    }

    /// Records the resolution first (actor `evidence`), keeps what was found
    /// on the attempt (the kept answer), then settles it by the same
    /// settlement as a live answer, which clears the kept answer; only then
    /// are the looks ended.
    async fn resolve(
        &self,
        unknown: &EvidenceDue,
        finished: Finished,
        (what, outcome): (&str, &'static str),
    ) -> Result<Look> {
        let judged = match &finished.verdict {
            Verdict::Succeeded(_) => "succeeded".to_owned(),
            Verdict::Failed { error, .. } | Verdict::Unknown { error } => error.clone(),
        };
        let action = Action {
            action: "attempt.evidence",
            job: Some(unknown.job_id),
            attempt: Some(unknown.attempt_id),
            target: Some(unknown.provider.clone()),
            detail: json!({
                "evidence": what,
                "request_id": finished.provider_request_id,
                "verdict": judged,
            }),
            ..Action::default()
        };
        let audit_rows = self.store.audit();
        let audit = audit_rows.begin(&Actor::evidence(), &action).await?;
        let found = format!("{what}: {judged}");
        // Kept first: whatever happens to the settlement below (a held row,
        // an error, a crash), the answer is on the attempt, and the
        // kept-answer pass settles it.
        let kept = self.store.kept();
        if !kept.keep_answer(&finished, Some(&found)).await? {
            tracing::info!(attempt_id = %unknown.attempt_id, "evidence: the attempt's row is held or it was settled meanwhile; looked at again after its lease");
            return Ok(Look {
                found: format!(
                    "{found} (not kept yet: its row was held or it was settled meanwhile)"
                ),
                outcome: "held",
                ..Look::default()
            });
        }
        let planner = planner::load_all(self.config, self.store).await?;
        let plan = |f: &FailedJob| planner.plan(f);
        let settle = self.store.settle();
        let (settled, publish) = settle
            .finalize(std::slice::from_ref(&finished), &plan)
            .await?;
        let settled = settled.first().cloned().unwrap_or(Settled::Stale);
        if settled == Settled::Busy {
            tracing::info!(attempt_id = %unknown.attempt_id, job_id = %unknown.job_id, evidence = what, "evidence: the job's rows are held; the answer found is kept on its attempt and settled by the kept-answer pass");
            return Ok(Look {
                found: format!("{found} (kept: its job's rows were held, it is settled shortly)"),
                outcome: "kept",
                ..Look::default()
            });
        }
        // Settled, and the kept answer cleared with it: no more looks.
        self.store
            .evidence()
            .note_evidence(unknown.attempt_id, &found, None)
            .await?;
        let settled = format!("{settled:?}");
        tracing::info!(attempt_id = %unknown.attempt_id, job_id = %unknown.job_id, evidence = what, %settled, "evidence: an unknown attempt was settled");
        let written = json!({ "settled": settled });
        if let Err(e) = audit_rows.outcome(audit, false, &written).await {
            tracing::warn!(error = %e, %audit, "evidence: the outcome was not written to its audit row");
        }
        Ok(Look {
            found,
            settled: Some(settled),
            outcome,
            publish,
        })
    }
}

/// Whether `unknown`'s evidence deadline has passed.
fn past_deadline(client: &Client, unknown: &EvidenceDue) -> bool {
    let deadline = client.provider().evidence.deadline;
    chrono::Utc::now()
        > unknown.started_at + chrono::Duration::from_std(deadline).unwrap_or(chrono::Duration::MAX)
}

/// The pause before the next look: the delay, doubled with each look, at
/// most [`MAX_PAUSE`].
fn pause(delay: Duration, looks: i32) -> Duration {
    let doublings = u32::try_from(looks.clamp(1, 16) - 1).unwrap_or(0);
    delay.saturating_mul(1 << doublings).min(MAX_PAUSE)
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
        asked: None,
    }
}

/// Whether `provider`'s evidence may be used: no qualification found its
/// claim false (a finding about another kind of evidence, from before the
/// configuration changed, does not count).
pub(crate) fn claim_holds(provider: &Provider, claim: Option<&EvidenceClaim>) -> bool {
    claim.is_none_or(|c| c.held || c.kind != provider.evidence.kind.as_str())
}

/// Where a provider's evidence stands, as `providers list` and the console
/// show it: its kind, whether the pass uses it (`none`, `on`, `unchecked`,
/// `off`), and why, in words.
pub(crate) fn standing(provider: &Provider, claim: Option<&EvidenceClaim>) -> serde_json::Value {
    let kind = provider.evidence.kind.as_str();
    let at = |c: &EvidenceClaim| c.checked_at.format("%Y-%m-%d %H:%M:%S UTC").to_string();
    let claim = claim.filter(|c| c.kind == kind);
    let (state, why) = match (provider.evidence.kind, claim) {
        (EvidenceKind::None, _) => (
            "none",
            "keeps none: unknowns wait for an operator".to_owned(),
        ),
        (_, None) => (
            "unchecked",
            "on; no qualification has tested the claim yet".to_owned(),
        ),
        (_, Some(c)) if c.held => ("on", format!("on; the claim held at {}", at(c))),
        (_, Some(c)) => (
            "off",
            format!(
                "off: the qualification at {} found the claim false ({}); unknowns wait for an operator until a qualification finds it holds",
                at(c),
                c.detail
            ),
        ),
    };
    json!({ "kind": kind, "state": state, "why": why })
}
