//! Calling the provider with the attempt id as `Idempotency-Key`, and judging
//! its answer against the operation's output contract.

use crate::edges::provider::Client;
use crate::edges::provider::answer::{CallError, verdict};
use crate::edges::store::{Finished, Started, Verdict};
use crate::settings::config::Config;
use crate::trace::TraceContext;

/// Calls the provider for a started attempt, in the attempt's trace, and
/// judges the answer.
pub(crate) async fn call(
    config: &Config,
    client: &Client,
    started: &Started,
    trace: &TraceContext,
) -> Finished {
    let mut finished = Finished {
        attempt_id: started.attempt_id,
        job_id: started.job_id,
        version: started.version,
        provider_request_id: None,
        usage: None,
        verdict: Verdict::Unknown {
            error: String::new(),
        },
        asked: Some(client.provider().evidence.kind),
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
            Some(trace),
            operation,
            &rendered,
        )
        .await;
    crate::edges::metrics::provider_call(
        &client.provider().name,
        match &answer {
            Ok(_) => "answered",
            Err(CallError::Refused(_)) => "refused",
            Err(CallError::Rejected { .. }) => "rejected",
            Err(CallError::Unknown(_)) => "unknown",
        },
        began.elapsed(),
    );
    finished.verdict = verdict(operation, answer, &mut finished);
    finished
}
