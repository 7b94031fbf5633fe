//! Calling the provider with the attempt id as `Idempotency-Key`, and judging
//! its answer against the operation's output contract.

use crate::config::{Config, Operation};
use crate::provider::{Answer, CallError, Client};
use crate::store::{Finished, Started, Verdict};

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
        .complete(
            started.attempt_id,
            Some(started.job_id),
            operation,
            &rendered,
        )
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
pub(super) fn judge(
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
