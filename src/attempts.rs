//! The attempt role: one consumer per provider, claiming and settling in
//! batches.
//!
//! Each delivery first takes one of the provider's call slots (`concurrency`),
//! so an attempt never waits for a slot once it has started. Then it is claimed
//! through the consumer's claim group commit: every delivery that got its slot
//! while the previous claim was committing is moved `queued → started` by one
//! guarded statement, which commits before any request leaves (a crash after
//! sending is then `unknown`). An attempt that does not start was a duplicate
//! delivery, is blocked behind an unknown (published again when the block
//! lifts), or names no attempt (dead-lettered). The started ones are called
//! concurrently, with the attempt id as `Idempotency-Key`, and each answer is
//! judged against the operation's output contract.
//!
//! Finished attempts are settled through the settle group commit, one
//! transaction per flush (up to `batch_size`, gathered for at most
//! `flush_interval` while another flush commits): still one compare-and-swap
//! per job, so two attempts of one job in the same flush have exactly one
//! winner, and a settlement Postgres refuses is settled apart from its
//! neighbours. A delivery is acked only after its settlement commits; the
//! outbox rows a flush wrote are published together, their confirms awaited
//! together, and marked published by one statement.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use lapin::message::Delivery;
use tokio::sync::Semaphore;

use crate::broker;
use crate::config::{Config, Operation};
use crate::domain::{AttemptId, AttemptStatus, JobStatus};
use crate::policy::Planner;
use crate::provider::{Answer, CallError, Client};
use crate::runtime::{
    self, Abandoned, Context, GroupCommit, Result, Stages, WorkerError, with_retries,
};
use crate::shutdown::Shutdown;
use crate::store::{FailedJob, Finished, OutboxMessage, Settled, Started, Verdict};

pub(crate) use crate::domain::AttemptMessage;

/// A claim's answer, or why the claim was not made.
type Claimed = std::result::Result<ClaimAnswer, String>;
/// A settlement's answer: `Ok(false)` when its rows were held under someone
/// else's lock (nothing written: settle it again later), `Err` when it was not
/// committed.
type Committed = std::result::Result<bool, String>;

/// What a claim did with one attempt.
#[derive(Debug)]
enum ClaimAnswer {
    /// Started: call its provider.
    Started(Started),
    /// Its job row was held under someone else's lock: claim it again later.
    Busy,
    /// Not started (a duplicate delivery, a blocked or ended job, no attempt).
    NotStarted,
}

/// The longest pause between two tries of a claim or settlement whose rows
/// are held: the wait grows from [`HELD_PAUSE_MIN`] to this.
const HELD_PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(2);
const HELD_PAUSE_MIN: std::time::Duration = std::time::Duration::from_millis(50);

/// Runs the consumer for `provider` until shutdown.
pub(crate) async fn run(ctx: Context, provider: String, shutdown: Shutdown) -> Result<()> {
    let settings = ctx
        .config
        .providers
        .get(&provider)
        .cloned()
        .ok_or_else(|| WorkerError::UnknownProvider(provider.clone()))?;
    let client =
        Arc::new(Client::new(settings.clone()).map_err(|e| {
            WorkerError::RoleStopped(format!("attempts({provider})"), e.to_string())
        })?);
    let concurrency = usize::try_from(settings.concurrency)
        .unwrap_or(usize::MAX)
        .min(Semaphore::MAX_PERMITS);
    let worker = &ctx.config.worker;
    let (claimer, claims) = {
        let (ctx, shutdown, client) = (ctx.clone(), shutdown.clone(), client.clone());
        // A claim nobody waits for any more (its handler was cut off at the end of
        // the shutdown grace) is not made: it would start an attempt no one calls.
        GroupCommit::start(
            Stages {
                wait: "claim_wait",
                flush: "claim",
            },
            worker.batch_size,
            worker.flush_interval,
            Abandoned::Skip,
            move |ids| {
                let (ctx, shutdown, client) = (ctx.clone(), shutdown.clone(), client.clone());
                async move { claim(&ctx, &shutdown, &client, ids).await }
            },
        )
    };
    let (completer, settlements) = {
        let (ctx, shutdown, name) = (ctx.clone(), shutdown.clone(), provider.clone());
        // A settlement is written even when its handler is gone: the call was made.
        GroupCommit::start(
            Stages {
                wait: "settle_wait",
                flush: "settle",
            },
            worker.batch_size,
            worker.flush_interval,
            Abandoned::Flush,
            move |batch| {
                let (ctx, shutdown, name) = (ctx.clone(), shutdown.clone(), name.clone());
                async move { settle(&ctx, &shutdown, &name, batch).await }
            },
        )
    };
    let consumer = Consumer {
        ctx: ctx.clone(),
        shutdown: shutdown.clone(),
        client,
        queue: broker::attempts_queue(&provider),
        calls: Arc::new(Semaphore::new(concurrency)),
        claims,
        settlements,
    };
    let queue = consumer.queue.clone();
    let consumer = Arc::new(consumer);
    let outcome = runtime::consume(
        &ctx,
        &queue,
        worker.attempt_prefetch,
        &shutdown,
        |delivery| {
            let consumer = consumer.clone();
            async move { consumer.handle(delivery).await }
        },
    )
    .await;
    // The handlers are done or cut off: the group commits finish what they were
    // handed, then stop.
    drop(consumer);
    let _ = tokio::join!(claimer, completer);
    outcome
}

/// What every delivery of one provider's consumer shares.
struct Consumer {
    ctx: Context,
    shutdown: Shutdown,
    client: Arc<Client>,
    queue: String,
    calls: Arc<Semaphore>,
    claims: GroupCommit<AttemptId, Claimed>,
    settlements: GroupCommit<(Started, Finished), Committed>,
}

impl Consumer {
    /// One delivery, from its call slot to its ack (or its return to the queue).
    async fn handle(&self, delivery: Delivery) {
        // The ack only once the work is done: a delivery whose work failed is
        // returned, never acked.
        let done = match self.work(&delivery).await {
            Ok(()) => crate::metrics::timed("attempt_ack", runtime::ack(&delivery)).await,
            Err(e) => Err(e),
        };
        if let Err(e) = done {
            tracing::error!(error = %e, "attempt not settled; returning it to the queue");
            runtime::requeue(&delivery).await;
        }
    }

    async fn work(&self, delivery: &Delivery) -> Result<()> {
        let waiting =
            crate::metrics::timed("attempt_slot_wait", self.calls.clone().acquire_owned());
        let Ok(slot) = waiting.await else {
            return Err(WorkerError::Unsettled("the call slots closed".into()));
        };
        // A stopping worker starts nothing new: what waited for a slot goes back.
        if self.shutdown.is_triggered() {
            return Err(WorkerError::Unsettled(
                "the worker is stopping before this attempt started".into(),
            ));
        }
        let message: AttemptMessage = match serde_json::from_slice(&delivery.data) {
            Ok(m) => m,
            Err(e) => {
                drop(slot);
                let reason = format!("malformed_attempt_message: {e}");
                return self.dead_letter(delivery, &reason).await;
            }
        };
        let Some(started) = self.claim(message.attempt_id).await? else {
            drop(slot);
            return self.not_started(delivery, &message).await;
        };
        let finished = crate::metrics::timed(
            "attempt_call",
            call(&self.ctx.config, &self.client, &started),
        )
        .await;
        drop(slot);
        self.settle(started, finished).await
    }

    /// Claims the attempt through the claim group commit. While its job row
    /// is held under someone else's lock it waits and claims again (the
    /// delivery stays with this worker meanwhile); `None` when it did not start.
    async fn claim(&self, attempt: AttemptId) -> Result<Option<Started>> {
        let mut pause = HELD_PAUSE_MIN;
        loop {
            let claimed = self.claims.submit(attempt).await;
            match claimed.unwrap_or_else(|| Err("the claims stopped".into())) {
                Ok(ClaimAnswer::Started(started)) => return Ok(Some(started)),
                Ok(ClaimAnswer::NotStarted) => return Ok(None),
                Ok(ClaimAnswer::Busy) => {}
                Err(e) => return Err(WorkerError::Unsettled(e)),
            }
            tracing::debug!(attempt_id = %attempt, "attempt's job row is held under another lock; claiming it again shortly");
            self.pause(&mut pause).await.map_err(|()| {
                WorkerError::Unsettled(
                    "the worker is stopping while this attempt's job row is held".into(),
                )
            })?;
        }
    }

    /// Settles a finished call through the settle group commit. An answer is
    /// kept until it is settled: while its rows are held under someone else's
    /// lock it waits and settles again. The flush has written the answer onto
    /// its attempt the first time it had to wait, and does before anything
    /// could hand its delivery back (a failed flush), so that the reconciler
    /// settles it if this worker stops ([`crate::store::Store::keep_answer`]).
    ///
    /// The answers waiting this way are bounded by the consumer's prefetch
    /// (`attempt_prefetch`): each holds its delivery, so at the bound the
    /// consumer takes no new delivery, and no new call is made, until the
    /// database lets settlements through again.
    async fn settle(&self, started: Started, finished: Finished) -> Result<()> {
        let mut pause = HELD_PAUSE_MIN;
        loop {
            let committed = self
                .settlements
                .submit((started.clone(), finished.clone()))
                .await
                .unwrap_or_else(|| Err("the completer stopped".into()));
            match committed {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(WorkerError::Unsettled(e)),
            }
            if self.pause(&mut pause).await.is_err() {
                return Err(WorkerError::Unsettled(
                    "the worker is stopping while this attempt's rows are held; its answer is kept on the attempt for the reconciler to settle".into(),
                ));
            }
        }
    }

    /// Waits `pause` (doubling it, up to [`HELD_PAUSE_MAX`]); `Err` when the
    /// worker is stopping.
    async fn pause(&self, pause: &mut std::time::Duration) -> std::result::Result<(), ()> {
        if self.shutdown.is_triggered() {
            return Err(());
        }
        let wait = *pause;
        *pause = (*pause * 2).min(HELD_PAUSE_MAX);
        tokio::select! {
            () = self.shutdown.wait() => Err(()),
            () = tokio::time::sleep(wait) => Ok(()),
        }
    }

    /// A message whose attempt did not start: a duplicate delivery, an attempt
    /// blocked behind an unknown (published again when the block lifts), or a
    /// message naming no such attempt (dead-lettered here). The delivery is
    /// acked either way.
    async fn not_started(&self, delivery: &Delivery, message: &AttemptMessage) -> Result<()> {
        let state = with_retries(&self.shutdown, "looking up an attempt", || async {
            Ok(self.ctx.store.attempt_state(message.attempt_id).await?)
        })
        .await?;
        match state {
            Some((job, AttemptStatus::Queued, JobStatus::Unknown)) if job == message.job_id => {
                // Blocked behind an unknown attempt. The attempt stays `queued`,
                // and the settlement that lifts the block publishes its message
                // again, so this delivery can go without costing a delivery count.
                tracing::info!(attempt_id = %message.attempt_id, job_id = %job, "attempt blocked: its job waits for an unknown attempt to be resolved; it is published again when it is");
                Ok(())
            }
            Some((job, _, _)) if job == message.job_id => {
                tracing::debug!(attempt_id = %message.attempt_id, "attempt is not queued any more: duplicate delivery dropped");
                Ok(())
            }
            _ => {
                let reason = format!(
                    "unknown_attempt: no attempt {} of job {} exists",
                    message.attempt_id, message.job_id
                );
                self.dead_letter(delivery, &reason).await
            }
        }
    }

    /// Keeps a message that names no attempt where an operator can see it, with
    /// the reason.
    async fn dead_letter(&self, delivery: &Delivery, reason: &str) -> Result<()> {
        tracing::warn!(%reason, "attempt message dead-lettered");
        with_retries(&self.shutdown, "dead-lettering an attempt message", || {
            self.ctx.publish_dead_letter(&self.queue, delivery, reason)
        })
        .await
    }
}

/// A claim flush: moves the attempts `queued → started` with one statement.
async fn claim(
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
            .claim(&provider.name, &ids, provider.timeout, token)
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

/// A settle flush: one transaction for every finished attempt in it; then each
/// is answered, and what the flush wrote is published.
async fn settle(
    ctx: &Context,
    shutdown: &Shutdown,
    provider: &str,
    batch: Vec<(Started, Finished)>,
) -> Vec<Committed> {
    crate::metrics::attempt_batch(provider, "settle", batch.len());
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
            // Their deliveries go back: their answers are kept first.
            for f in &finished {
                keep(ctx, f).await;
            }
            let why = e.to_string();
            return finished.iter().map(|_| Err(why.clone())).collect();
        }
    };
    let mut answers = Vec::with_capacity(finished.len());
    for ((started, finished), outcome) in started.iter().zip(&finished).zip(outcomes) {
        log_settled(started, finished, &outcome);
        crate::metrics::attempt_settled(provider, settled_label(&outcome));
        answers.push(match outcome {
            Settled::Refused { error } => {
                keep(ctx, finished).await;
                Err(error)
            }
            // Kept here, in the flush, so that it is kept even when its
            // handler is gone (cut off at the end of a stop).
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
        let published = crate::metrics::timed("settle_publish", ctx.publish_outbox(&publish));
        if let Err(e) = published.await {
            tracing::warn!(error = %e, "publish after settling failed; the relay will retry");
        }
    });
    answers
}

/// The store's settlement of `finished`, waiting out outages. Only definite
/// failures (of the `failing` operations) need to know who may take the next
/// attempt.
async fn settle_all(
    ctx: &Context,
    shutdown: &Shutdown,
    finished: &[Finished],
    failing: &BTreeSet<String>,
) -> Result<(Vec<Settled>, Vec<OutboxMessage>)> {
    let planner = if failing.is_empty() {
        Planner::unqualified(&ctx.config)
    } else {
        with_retries(shutdown, "reading qualifications", || async {
            Ok(Planner::load(&ctx.config, &ctx.store, failing.iter().map(String::as_str)).await?)
        })
        .await?
    };
    let plan = |failed: &FailedJob| planner.plan(failed);
    with_retries(shutdown, "settling attempts", || async {
        Ok(ctx.store.finalize(finished, &plan).await?)
    })
    .await
}

/// Writes an answer that could not be settled now onto its attempt, for the
/// reconciler to settle if its worker stops first; best effort, logged.
async fn keep(ctx: &Context, finished: &Finished) {
    match ctx.store.keep_answer(finished).await {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(attempt_id = %finished.attempt_id, "an unsettled answer could not be kept: its attempt row is held or no longer open")
        }
        Err(e) => {
            tracing::warn!(attempt_id = %finished.attempt_id, error = %e, "could not keep an unsettled answer on its attempt")
        }
    }
}

fn settled_label(settled: &Settled) -> &'static str {
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

/// Calls the provider for a started attempt and judges the answer.
pub(crate) async fn call(config: &Config, client: &Client, started: &Started) -> Finished {
    let mut finished = Finished {
        attempt_id: started.attempt_id,
        job_id: started.job_id,
        version: started.version,
        provider_request_id: None,
        usage: None,
        verdict: Verdict::Unknown {
            error: String::new(),
        },
    };
    let Some(operation) = config.operations.get(&started.operation) else {
        finished.verdict = Verdict::Failed {
            error: format!(
                "unknown_operation: {:?} is no longer configured",
                started.operation
            ),
            retryable: false,
            retry_after: None,
        };
        return finished;
    };
    let rendered = match config.render(operation, &started.input) {
        Ok(r) => r,
        Err(e) => {
            // No provider can do better with the same input: no further attempt.
            finished.verdict = Verdict::Failed {
                error: e.to_string(),
                retryable: false,
                retry_after: None,
            };
            return finished;
        }
    };
    let began = std::time::Instant::now();
    let answer = client
        .complete(started.attempt_id, operation, &rendered)
        .await;
    crate::metrics::provider_call(
        &client.provider().name,
        match &answer {
            Ok(_) => "answered",
            Err(CallError::Refused(_)) => "refused",
            Err(CallError::Rejected { .. }) => "rejected",
            Err(CallError::Unknown(_)) => "unknown",
        },
        began.elapsed(),
    );
    finished.verdict = judge(operation, answer, &mut finished);
    finished
}

/// The verdict on a provider's answer: a success only when the output meets
/// the operation's contract; the provider's usage and request id are kept
/// whatever the verdict.
fn judge(
    operation: &Operation,
    answer: std::result::Result<Answer, CallError>,
    finished: &mut Finished,
) -> Verdict {
    match answer {
        Ok(answer) => {
            finished.provider_request_id = answer.request_id;
            finished.usage = answer.usage;
            match operation.check_output(&answer.content) {
                Ok(value) => Verdict::Succeeded(value),
                Err(violation) => Verdict::Failed {
                    error: violation.to_string(),
                    retryable: true,
                    retry_after: None,
                },
            }
        }
        Err(CallError::Unknown(e)) => Verdict::Unknown {
            error: format!("outcome_unknown: {e}"),
        },
        Err(e @ CallError::Refused(_)) => Verdict::Failed {
            error: e.to_string(),
            retryable: true,
            retry_after: None,
        },
        Err(e @ CallError::Rejected { .. }) => {
            let mut wait = None;
            if let CallError::Rejected {
                usage, retry_after, ..
            } = &e
            {
                finished.usage = usage.clone();
                wait = *retry_after;
            }
            Verdict::Failed {
                error: e.to_string(),
                retryable: true,
                retry_after: wait,
            }
        }
    }
}

fn log_settled(started: &Started, finished: &Finished, settled: &Settled) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{AttemptId, JobId};

    fn blank() -> Finished {
        Finished {
            attempt_id: AttemptId::new(),
            job_id: JobId::new(),
            version: 1,
            provider_request_id: None,
            usage: None,
            verdict: Verdict::Unknown {
                error: String::new(),
            },
        }
    }

    fn summarize() -> Operation {
        let config = Config::parse(crate::config::EMBEDDED_DEFAULT, "embedded defaults").unwrap();
        config.operations["summarize"].clone()
    }

    fn answer(content: &str) -> Answer {
        Answer {
            content: content.into(),
            request_id: Some("chatcmpl-1".into()),
            usage: Some(serde_json::json!({"total_tokens": 9})),
        }
    }

    #[test]
    fn only_an_answer_that_meets_the_contract_succeeds_and_usage_is_kept_either_way() {
        let op = summarize();
        let mut f = blank();
        let verdict = judge(&op, Ok(answer(r#"{"summary":"ok"}"#)), &mut f);
        assert_eq!(
            verdict,
            Verdict::Succeeded(serde_json::json!({"summary": "ok"}))
        );
        assert_eq!(f.provider_request_id.as_deref(), Some("chatcmpl-1"));
        let mut f = blank();
        let verdict = judge(&op, Ok(answer("Sure! Here is a summary.")), &mut f);
        assert!(
            matches!(&verdict, Verdict::Failed { retryable: true, retry_after: None, error } if error.starts_with("contract_violation")),
            "{verdict:?}"
        );
        assert_eq!(f.usage, Some(serde_json::json!({"total_tokens": 9})));
    }

    #[test]
    fn errors_are_definite_failures_and_timeouts_are_unknown() {
        let op = summarize();
        let mut f = blank();
        let rejected = CallError::Rejected {
            message: "HTTP 429".into(),
            retry_after: Some(std::time::Duration::from_secs(7)),
            usage: Some(serde_json::json!({"total_tokens": 1})),
        };
        assert_eq!(
            judge(&op, Err(rejected), &mut f),
            Verdict::Failed {
                error: "provider_error: HTTP 429".into(),
                retryable: true,
                retry_after: Some(std::time::Duration::from_secs(7)),
            }
        );
        assert_eq!(f.usage, Some(serde_json::json!({"total_tokens": 1})));
        let refused = judge(&op, Err(CallError::Refused("connect".into())), &mut blank());
        assert!(matches!(
            refused,
            Verdict::Failed {
                retry_after: None,
                retryable: true,
                ..
            }
        ));
        assert_eq!(
            judge(
                &op,
                Err(CallError::Unknown("timed out".into())),
                &mut blank()
            ),
            Verdict::Unknown {
                error: "outcome_unknown: timed out".into()
            }
        );
    }
}
