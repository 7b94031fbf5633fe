//! The attempt role: one consumer per provider, in batches.
//!
//! Every delivery that is ready (up to `batch_size`, and never more than the
//! provider's free call slots) is claimed by one guarded statement, `queued →
//! started`, which commits before any request leaves: a crash after sending is
//! then `unknown`. An attempt that does not start was a duplicate delivery, is
//! blocked behind an unknown (published again when the block lifts), or names
//! no attempt (dead-lettered). The started ones are called concurrently, with
//! the attempt id as `Idempotency-Key`, and each answer is judged against the
//! operation's output contract.
//!
//! Finished attempts go to the provider's completer, which settles all that
//! arrive within `flush_interval` (up to `batch_size`) in one transaction: still
//! one compare-and-swap per job, so two attempts of one job in the same flush
//! have exactly one winner, and one settlement Postgres refuses is settled apart
//! from its neighbours. A delivery is acked only after its settlement commits;
//! the outbox rows a flush wrote are published together, their confirms awaited
//! together, and marked published by one statement.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use futures_util::future::join_all;
use lapin::message::Delivery;
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::broker;
use crate::config::{Config, Operation};
use crate::domain::{AttemptId, AttemptStatus, JobStatus};
use crate::policy::Planner;
use crate::provider::{Answer, CallError, Client};
use crate::runtime::{self, Context, Result, WorkerError, with_retries};
use crate::shutdown::Shutdown;
use crate::store::{FailedJob, Finished, Settled, Started, Verdict};

pub(crate) use crate::domain::AttemptMessage;

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
    let queue = broker::attempts_queue(&provider);
    // The semaphore caps calls in flight; a batch takes its slots before it
    // claims, so an attempt never waits for a slot after it has started.
    let concurrency = usize::try_from(settings.concurrency)
        .unwrap_or(usize::MAX)
        .min(Semaphore::MAX_PERMITS);
    let calls = Arc::new(Semaphore::new(concurrency));
    let (completer, settle) = Completer::start(&ctx, &shutdown, &provider);
    let batching = runtime::Batching {
        max_batch: ctx.config.worker.batch_size.min(concurrency).max(1),
        max_in_flight: concurrency,
    };
    let prefetch = ctx.config.worker.attempt_prefetch;
    let outcome =
        runtime::consume_batches(&ctx, &queue, prefetch, batching, &shutdown, |deliveries| {
            let batch = Batch {
                ctx: ctx.clone(),
                shutdown: shutdown.clone(),
                client: client.clone(),
                queue: queue.clone(),
                settle: settle.clone(),
            };
            let calls = calls.clone();
            async move { batch.handle(calls, deliveries).await }
        })
        .await;
    // The handlers are done or cut off: the completer settles what they handed
    // it, then stops.
    drop(settle);
    let _ = completer.await;
    outcome
}

/// What a batch of deliveries needs.
struct Batch {
    ctx: Context,
    shutdown: Shutdown,
    client: Arc<Client>,
    queue: String,
    settle: Completer,
}

impl Batch {
    /// Takes call slots for the batch, claims its attempts with one statement,
    /// calls the started ones concurrently and hands each answer to the
    /// completer; each delivery is acked once its settlement has committed, or
    /// returned to the queue.
    async fn handle(&self, calls: Arc<Semaphore>, deliveries: Vec<Delivery>) {
        let slots = u32::try_from(deliveries.len()).unwrap_or(u32::MAX);
        let Ok(mut permits) = calls.acquire_many_owned(slots).await else {
            return; // never closed
        };
        let mut claims = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            match serde_json::from_slice::<AttemptMessage>(&delivery.data) {
                Ok(message) => claims.push((delivery, message)),
                Err(e) => {
                    drop(permits.split(1));
                    let reason = format!("malformed_attempt_message: {e}");
                    let copied = self.dead_letter(&delivery, &reason).await;
                    settle_delivery(&delivery, copied).await;
                }
            }
        }
        if claims.is_empty() {
            return;
        }
        let mut started = match self.claim(&claims).await {
            Ok(started) => started,
            Err(e) => {
                tracing::error!(error = %e, "attempts not claimed; returning them to the queue");
                for (delivery, _) in &claims {
                    runtime::requeue(delivery).await;
                }
                return;
            }
        };
        join_all(claims.into_iter().map(|(delivery, message)| {
            let slot = permits.split(1);
            let started = started.remove(&message.attempt_id);
            async move {
                let result = match started {
                    Some(started) => {
                        let finished = call(&self.ctx.config, &self.client, &started).await;
                        drop(slot);
                        self.settle.settle(started, finished).await
                    }
                    None => {
                        drop(slot);
                        self.not_started(&delivery, &message).await
                    }
                };
                settle_delivery(&delivery, result).await;
            }
        }))
        .await;
    }

    /// Moves the messages' attempts `queued → started` with one statement.
    async fn claim(
        &self,
        claims: &[(Delivery, AttemptMessage)],
    ) -> Result<HashMap<AttemptId, Started>> {
        let provider = self.client.provider();
        let ids: Vec<AttemptId> = claims.iter().map(|(_, m)| m.attempt_id).collect();
        let started = with_retries(&self.shutdown, "starting attempts", || async {
            Ok(self
                .ctx
                .store
                .start(&provider.name, &ids, provider.timeout)
                .await?)
        })
        .await?;
        crate::metrics::attempt_batch(&provider.name, "claim", ids.len());
        Ok(started.into_iter().map(|s| (s.attempt_id, s)).collect())
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

/// Acks a delivery whose work is done, or returns it to the queue.
async fn settle_delivery(delivery: &Delivery, done: Result<()>) {
    if let Err(e) = done.and(runtime::ack(delivery).await) {
        tracing::error!(error = %e, "attempt not settled; returning it to the queue");
        runtime::requeue(delivery).await;
    }
}

/// A finished attempt waiting for its flush.
struct Settlement {
    started: Started,
    finished: Finished,
    done: oneshot::Sender<Result<()>>,
}

/// The way to a provider's completer: the group commit of its settlements.
#[derive(Clone)]
struct Completer {
    queue: mpsc::UnboundedSender<Settlement>,
}

impl Completer {
    /// Starts the completer task of `provider`; it stops once every handle to it
    /// is dropped and what they sent is settled.
    fn start(
        ctx: &Context,
        shutdown: &Shutdown,
        provider: &str,
    ) -> (tokio::task::JoinHandle<()>, Completer) {
        let (queue, pending) = mpsc::unbounded_channel();
        let task = tokio::spawn(complete(
            ctx.clone(),
            shutdown.clone(),
            provider.to_owned(),
            pending,
        ));
        (task, Completer { queue })
    }

    /// Settles a finished attempt with the next flush; `Ok` once it committed.
    async fn settle(&self, started: Started, finished: Finished) -> Result<()> {
        let (done, committed) = oneshot::channel();
        let stopped = || WorkerError::Unsettled("the completer stopped".into());
        self.queue
            .send(Settlement {
                started,
                finished,
                done,
            })
            .map_err(|_| stopped())?;
        committed.await.unwrap_or_else(|_| Err(stopped()))
    }
}

/// The completer's loop: a flush takes every settlement that arrives within
/// `flush_interval` of the first, up to `batch_size`. Flushes run one after
/// another, so while one commits the next one's settlements gather.
async fn complete(
    ctx: Context,
    shutdown: Shutdown,
    provider: String,
    mut pending: mpsc::UnboundedReceiver<Settlement>,
) {
    let (size, interval) = (
        ctx.config.worker.batch_size,
        ctx.config.worker.flush_interval,
    );
    while let Some(first) = pending.recv().await {
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + interval;
        while batch.len() < size {
            match tokio::time::timeout_at(deadline, pending.recv()).await {
                Ok(Some(next)) => batch.push(next),
                Ok(None) | Err(_) => break,
            }
        }
        flush(&ctx, &shutdown, &provider, batch).await;
    }
}

/// Settles a flush in one transaction, answers each settlement, then publishes
/// what the flush wrote.
async fn flush(ctx: &Context, shutdown: &Shutdown, provider: &str, batch: Vec<Settlement>) {
    crate::metrics::attempt_batch(provider, "settle", batch.len());
    let mut finished = Vec::with_capacity(batch.len());
    let mut waiting = Vec::with_capacity(batch.len());
    for s in batch {
        finished.push(s.finished);
        waiting.push((s.started, s.done));
    }
    let failing: BTreeSet<String> = waiting
        .iter()
        .zip(&finished)
        .filter(|(_, f)| matches!(f.verdict, Verdict::Failed { .. }))
        .map(|((started, _), _)| started.operation.clone())
        .collect();
    let settled = settle_all(ctx, shutdown, &finished, &failing).await;
    let (outcomes, publish) = match settled {
        Ok(settled) => settled,
        Err(e) => {
            let why = e.to_string();
            for (_, done) in waiting {
                let _ = done.send(Err(WorkerError::Unsettled(why.clone())));
            }
            return;
        }
    };
    for (((started, done), finished), outcome) in waiting.into_iter().zip(&finished).zip(outcomes) {
        log_settled(&started, finished, Some(&outcome));
        crate::metrics::attempt_settled(provider, settled_label(&outcome));
        let _ = done.send(match outcome {
            Settled::Refused { error } => Err(WorkerError::Unsettled(error)),
            _ => Ok(()),
        });
    }
    if let Err(e) = ctx.publish_outbox(&publish).await {
        tracing::warn!(error = %e, "publish after settling failed; the relay will retry");
    }
}

/// The store's settlement of `finished`, waiting out outages. Only definite
/// failures (of the `failing` operations) need to know who may take the next
/// attempt.
async fn settle_all(
    ctx: &Context,
    shutdown: &Shutdown,
    finished: &[Finished],
    failing: &BTreeSet<String>,
) -> Result<(Vec<Settled>, Vec<crate::store::OutboxMessage>)> {
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

fn settled_label(settled: &Settled) -> &'static str {
    match settled {
        Settled::Won => "won",
        Settled::Discarded { .. } => "discarded",
        Settled::Failed { .. } => "failed",
        Settled::Unknown => "unknown",
        Settled::Stale => "unchanged",
        Settled::Refused { .. } => "refused",
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

fn log_settled(started: &Started, finished: &Finished, settled: Option<&Settled>) {
    match (settled, &finished.verdict) {
        (Some(Settled::Won), _) => {
            tracing::info!(job_id = %started.job_id, attempt_id = %started.attempt_id, "attempt succeeded and won")
        }
        (Some(Settled::Discarded { winner }), _) => tracing::info!(
            job_id = %started.job_id,
            discarded_attempt = %started.attempt_id,
            winning_attempt = ?winner.map(|w| w.to_string()),
            "attempt finished after another had won: discarded"
        ),
        (Some(Settled::Failed { next, job_failed }), Verdict::Failed { error, .. }) => {
            tracing::warn!(
                job_id = %started.job_id,
                attempt_id = %started.attempt_id,
                %error,
                next_attempt = ?next.map(|n| n.to_string()),
                job_failed,
                "attempt failed"
            )
        }
        (Some(Settled::Refused { error }), _) => tracing::error!(
            job_id = %started.job_id,
            attempt_id = %started.attempt_id,
            %error,
            "Postgres refused this settlement; the delivery goes back to the queue"
        ),
        (Some(Settled::Unknown), Verdict::Unknown { error }) => tracing::warn!(
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
