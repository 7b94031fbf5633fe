//! The attempt role: one consumer per provider.
//!
//! Each attempt message is claimed with the guarded transition `queued → started`
//! (zero rows changed means a duplicate delivery: ack and drop). The provider is
//! called with the attempt id as `Idempotency-Key`; its answer is checked against
//! the operation's output contract, and the result is settled by the store: the
//! compare-and-swap for a success, `unknown` for a timeout or a connection lost
//! after sending, the route rule for a definite failure. The delivery is acked
//! after the commit.

use std::sync::Arc;

use lapin::message::Delivery;
use tokio::sync::Semaphore;

use crate::broker;
use crate::config::{Config, Operation};
use crate::domain::{AttemptStatus, JobStatus};
use crate::policy::Planner;
use crate::provider::{Answer, CallError, Client};
use crate::runtime::{self, Context, Result, with_retries};
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
        .ok_or_else(|| runtime::WorkerError::UnknownProvider(provider.clone()))?;
    let client = Arc::new(Client::new(settings.clone()).map_err(|e| {
        runtime::WorkerError::RoleStopped(format!("attempts({provider})"), e.to_string())
    })?);
    let queue = broker::attempts_queue(&provider);
    // Prefetch and the semaphore both cap in-flight calls, whatever the backlog.
    let concurrency = u16::try_from(settings.concurrency).unwrap_or(u16::MAX);
    let calls = Arc::new(Semaphore::new(usize::from(concurrency)));
    runtime::consume(&ctx, &queue, concurrency, &shutdown, |delivery| {
        let ctx = ctx.clone();
        let client = client.clone();
        let queue = queue.clone();
        let calls = calls.clone();
        let shutdown = shutdown.clone();
        async move {
            let Ok(_permit) = calls.acquire_owned().await else {
                return;
            };
            if let Err(e) = process(&ctx, &shutdown, &client, &queue, &delivery).await {
                tracing::error!(error = %e, "attempt not settled; returning it to the queue");
                runtime::requeue(&delivery).await;
            }
        }
    })
    .await
}

async fn process(
    ctx: &Context,
    shutdown: &Shutdown,
    client: &Client,
    queue: &str,
    delivery: &Delivery,
) -> Result<()> {
    let message: AttemptMessage = match serde_json::from_slice(&delivery.data) {
        Ok(m) => m,
        Err(e) => {
            let reason = format!("malformed_attempt_message: {e}");
            dead_letter(ctx, shutdown, queue, delivery, &reason).await?;
            return runtime::ack(delivery).await;
        }
    };
    if let Some(started) = claim(ctx, shutdown, client, queue, delivery, &message).await? {
        let finished = call(&ctx.config, client, &started).await;
        settle(ctx, shutdown, &client.provider().name, &started, &finished).await?;
    }
    runtime::ack(delivery).await
}

/// Keeps a message that names no attempt where an operator can see it, with
/// the reason.
async fn dead_letter(
    ctx: &Context,
    shutdown: &Shutdown,
    queue: &str,
    delivery: &Delivery,
    reason: &str,
) -> Result<()> {
    tracing::warn!(%reason, "attempt message dead-lettered");
    with_retries(shutdown, "dead-lettering an attempt message", || {
        ctx.publish_dead_letter(queue, delivery, reason)
    })
    .await
}

/// Moves the message's attempt `queued → started`. `None` when it did not
/// start: a duplicate delivery, an attempt blocked behind an unknown (published
/// again when the block lifts), or a message naming no such attempt
/// (dead-lettered here). The delivery is acked by the caller either way.
async fn claim(
    ctx: &Context,
    shutdown: &Shutdown,
    client: &Client,
    queue: &str,
    delivery: &Delivery,
    message: &AttemptMessage,
) -> Result<Option<Started>> {
    let provider = client.provider();
    let started = with_retries(shutdown, "starting an attempt", || async {
        Ok(ctx
            .store
            .start(&provider.name, &[message.attempt_id], provider.timeout)
            .await?)
    })
    .await?;
    if let Some(started) = started.into_iter().next() {
        return Ok(Some(started));
    }
    let state = with_retries(shutdown, "looking up an attempt", || async {
        Ok(ctx.store.attempt_state(message.attempt_id).await?)
    })
    .await?;
    match state {
        Some((job, AttemptStatus::Queued, JobStatus::Unknown)) if job == message.job_id => {
            // Blocked behind an unknown attempt. The attempt stays `queued`, and
            // the settlement that lifts the block publishes its message again, so
            // this delivery can go without costing it a delivery count.
            tracing::info!(attempt_id = %message.attempt_id, job_id = %job, "attempt blocked: its job waits for an unknown attempt to be resolved; it is published again when it is");
        }
        Some((job, _, _)) if job == message.job_id => {
            tracing::debug!(attempt_id = %message.attempt_id, "attempt is not queued any more: duplicate delivery dropped");
        }
        _ => {
            let reason = format!(
                "unknown_attempt: no attempt {} of job {} exists",
                message.attempt_id, message.job_id
            );
            dead_letter(ctx, shutdown, queue, delivery, &reason).await?;
        }
    }
    Ok(None)
}

/// Settles a finished attempt (the compare-and-swap, or what follows a
/// failure), counts it, and publishes what the settlement wrote.
async fn settle(
    ctx: &Context,
    shutdown: &Shutdown,
    provider: &str,
    started: &Started,
    finished: &Finished,
) -> Result<()> {
    // Only a definite failure needs to know who may take the next attempt.
    let planner = match finished.verdict {
        Verdict::Failed { .. } => {
            with_retries(shutdown, "reading qualifications", || async {
                Ok(Planner::load(&ctx.config, &ctx.store, [started.operation.as_str()]).await?)
            })
            .await?
        }
        _ => Planner::unqualified(&ctx.config),
    };
    let plan = |failed: &FailedJob| planner.plan(failed);
    let (settled, publish) = with_retries(shutdown, "settling an attempt", || async {
        Ok(ctx
            .store
            .finalize(std::slice::from_ref(finished), &plan)
            .await?)
    })
    .await?;
    log_settled(started, finished, settled.first());
    crate::metrics::attempt_settled(
        provider,
        match settled.first() {
            Some(Settled::Won) => "won",
            Some(Settled::Discarded { .. }) => "discarded",
            Some(Settled::Failed { .. }) => "failed",
            Some(Settled::Unknown) => "unknown",
            Some(Settled::Stale) | None => "unchanged",
        },
    );
    if let Err(e) = ctx.publish_outbox(&publish).await {
        tracing::warn!(error = %e, "publish after settling failed; the relay will retry");
    }
    Ok(())
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
