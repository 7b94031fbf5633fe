//! Settling: finished attempts share one transaction per flush, still one
//! compare-and-swap per job; a settlement Postgres refuses is settled apart,
//! and a paid answer is kept even when it lost.

use crate::policy::next::FailedJob;
use std::collections::BTreeSet;

use crate::edges::shutdown::Shutdown;
use crate::edges::store::{Finished, OutboxMessage, Settled, Started, Verdict};
use crate::policy::next::Planner;
use crate::shared::planner;
use crate::shared::runtime::{Context, Result, with_retries};

/// A settlement's answer: `Ok(false)` when its rows were held under someone
/// else's lock (nothing written: settle it again later), `Err` when it was not
/// committed.
pub(super) type Committed = std::result::Result<bool, String>;

/// A settle flush: one transaction for every finished attempt in it; then each
/// is answered, and what the flush wrote is published.
pub(super) async fn settle(
    ctx: &Context,
    shutdown: &Shutdown,
    provider: &str,
    batch: Vec<(Started, Finished)>,
) -> Vec<Committed> {
    crate::edges::metrics::attempt_batch(provider, "settle", batch.len());
    let (started, finished): (Vec<Started>, Vec<Finished>) = batch.into_iter().unzip();
    let failing: BTreeSet<String> = started
        .iter()
        .zip(&finished)
        .filter(|(_, f)| matches!(f.verdict, Verdict::Failed { .. }))
        .map(|(s, _)| s.operation.clone())
        .collect();
    let (outcomes, publish) = match settle_all(ctx, shutdown, &finished, &failing).await {
        Ok(settled) => settled,
        Err(e) => {
            // Their deliveries go back: their answers are kept first. One
            // that cannot be kept (Postgres unreachable at a stop) is handed
            // on through the broker, and its delivery goes.
            let why = e.to_string();
            let mut answers = Vec::with_capacity(finished.len());
            for (s, f) in started.iter().zip(&finished) {
                answers.push(match keep_or_hand_on(ctx, s, f).await {
                    Unsettled::HandedOn => Ok(true),
                    Unsettled::Kept | Unsettled::Lost => Err(why.clone()),
                });
            }
            return answers;
        }
    };
    let mut answers = Vec::with_capacity(finished.len());
    for ((started, finished), outcome) in started.iter().zip(&finished).zip(outcomes) {
        log_settled(started, finished, &outcome);
        crate::edges::metrics::attempt_settled(provider, settled_label(&outcome));
        answers.push(match outcome {
            Settled::Refused { error } => {
                keep(ctx, finished).await;
                Err(error)
            }
            // Kept here, in the flush, so that it is kept even when its
            // handler is gone (cut off at the end of a stop). At a stop, one
            // that cannot be kept (its attempt row held too) is handed on
            // through the broker; otherwise its handler settles it again.
            Settled::Busy if shutdown.is_triggered() => {
                match keep_or_hand_on(ctx, started, finished).await {
                    Unsettled::HandedOn => Ok(true),
                    Unsettled::Kept | Unsettled::Lost => Ok(false),
                }
            }
            Settled::Busy => {
                keep(ctx, finished).await;
                Ok(false)
            }
            _ => Ok(true),
        });
    }
    // The answers let the acks go at once; the publishes need not hold up the
    // next flush.
    if publish.is_empty() {
        return answers;
    }
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let published =
            crate::edges::metrics::timed("settle_publish", ctx.publish_outbox(&publish));
        if let Err(e) = published.await {
            tracing::warn!(error = %e, "publish after settling failed; the relay will retry");
        }
    });
    answers
}

/// The store's settlement of `finished`, waiting out outages. Only definite
/// failures (of the `failing` operations) need to know who may take the next
/// attempt.
pub(super) async fn settle_all(
    ctx: &Context,
    shutdown: &Shutdown,
    finished: &[Finished],
    failing: &BTreeSet<String>,
) -> Result<(Vec<Settled>, Vec<OutboxMessage>)> {
    let planner = if failing.is_empty() {
        Planner::unqualified(&ctx.config)
    } else {
        with_retries(shutdown, "reading qualifications", || async {
            Ok(planner::load(&ctx.config, &ctx.store, failing.iter().map(String::as_str)).await?)
        })
        .await?
    };
    let plan = |failed: &FailedJob| planner.plan(failed);
    with_retries(shutdown, "settling attempts", || async {
        Ok(ctx.store.settle().finalize(finished, &plan).await?)
    })
    .await
}

/// Writes an answer that could not be settled now onto its attempt, for the
/// reconciler to settle if its worker stops first; best effort, logged.
/// Whether it was kept.
pub(super) async fn keep(ctx: &Context, finished: &Finished) -> bool {
    match ctx.store.kept().keep_answer(finished, None).await {
        Ok(true) => true,
        Ok(false) => {
            tracing::warn!(attempt_id = %finished.attempt_id, "an unsettled answer could not be kept: its attempt row is held or no longer open");
            false
        }
        Err(e) => {
            tracing::warn!(attempt_id = %finished.attempt_id, error = %e, "could not keep an unsettled answer on its attempt");
            false
        }
    }
}

/// Where an answer that could not be settled now went instead.
enum Unsettled {
    /// Onto its attempt.
    Kept,
    /// To the queue of settlements handed on, confirmed by the broker.
    HandedOn,
    /// Nowhere: its attempt becomes `unknown` at its deadline.
    Lost,
}

/// Keeps an answer that could not be settled on its attempt, or, when that
/// cannot be done (Postgres unreachable, or the attempt row held), hands it
/// on to `onejob.settlements` with a confirm, for any worker to settle once
/// it can ([`crate::shared::handed_on`]).
async fn keep_or_hand_on(ctx: &Context, started: &Started, finished: &Finished) -> Unsettled {
    if keep(ctx, finished).await {
        return Unsettled::Kept;
    }
    let settlement = crate::shared::handed_on::Settlement::of(started, finished);
    let handed = async {
        let body = serde_json::to_vec(&settlement).map_err(|e| e.to_string())?;
        let properties = crate::broker::json_properties()
            .with_message_id(finished.attempt_id.to_string().into());
        ctx.publisher
            .publish(
                crate::broker::EXCHANGE,
                crate::broker::SETTLEMENTS_KEY,
                &body,
                properties,
                true,
            )
            .await
            .map_err(|e| e.to_string())
    };
    match handed.await {
        Ok(()) => {
            tracing::warn!(attempt_id = %finished.attempt_id, job_id = %finished.job_id, "an answer that could be neither settled nor kept was handed on to {} for any worker to settle", crate::broker::SETTLEMENTS_QUEUE);
            crate::edges::metrics::settlement_handed_on("published");
            Unsettled::HandedOn
        }
        Err(e) => {
            tracing::error!(attempt_id = %finished.attempt_id, job_id = %finished.job_id, error = %e, "an answer could be neither settled, kept nor handed on: its attempt becomes unknown at its deadline");
            crate::edges::metrics::settlement_handed_on("lost");
            Unsettled::Lost
        }
    }
}

pub(super) fn settled_label(settled: &Settled) -> &'static str {
    match settled {
        Settled::Won => "won",
        Settled::Discarded { .. } => "discarded",
        Settled::Failed { .. } => "failed",
        Settled::Unknown => "unknown",
        Settled::Stale => "unchanged",
        Settled::Refused { .. } => "refused",
        Settled::Busy => "busy",
    }
}

pub(super) fn log_settled(started: &Started, finished: &Finished, settled: &Settled) {
    match (settled, &finished.verdict) {
        (Settled::Won, _) => {
            tracing::info!(job_id = %started.job_id, attempt_id = %started.attempt_id, "attempt succeeded and won")
        }
        (Settled::Discarded { winner }, _) => tracing::info!(
            job_id = %started.job_id,
            discarded_attempt = %started.attempt_id,
            winning_attempt = ?winner.map(|w| w.to_string()),
            "attempt finished after another had won: discarded"
        ),
        (Settled::Failed { next, job_failed }, Verdict::Failed { error, .. }) => {
            tracing::warn!(
                job_id = %started.job_id,
                attempt_id = %started.attempt_id,
                %error,
                next_attempt = ?next.map(|n| n.to_string()),
                job_failed,
                "attempt failed"
            )
        }
        (Settled::Busy, _) => tracing::info!(
            job_id = %started.job_id,
            attempt_id = %started.attempt_id,
            "the job's rows are held under another lock; the answer waits and is settled again shortly"
        ),
        (Settled::Refused { error }, _) => tracing::error!(
            job_id = %started.job_id,
            attempt_id = %started.attempt_id,
            %error,
            "Postgres refused this settlement; the delivery goes back to the queue"
        ),
        (Settled::Unknown, Verdict::Unknown { error }) => tracing::warn!(
            job_id = %started.job_id,
            attempt_id = %started.attempt_id,
            %error,
            "attempt outcome unknown: the job waits for resolution"
        ),
        (other, _) => tracing::info!(
            job_id = %started.job_id,
            attempt_id = %started.attempt_id,
            settled = ?other,
            "attempt was resolved elsewhere meanwhile; its outcome changed nothing"
        ),
    }
}
