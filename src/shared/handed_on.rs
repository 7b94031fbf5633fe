//! Settlements handed on through the broker (`onejob.settlements`, contract
//! section 2): a paid answer whose worker stops while Postgres is unreachable
//! can neither be settled nor kept on its attempt (both need the database).
//! Rather than lose it, the worker publishes it, with a confirm, to a durable
//! queue; any worker's reconciler takes it once Postgres is back and keeps it
//! on its attempt, where the kept-answer pass settles it by the same
//! compare-and-swap as a live answer. A duplicate settles nothing.
//!
//! A settlement carries a result, so it must prove where it comes from: it
//! names the claim its attempt was started under (`attempts.claim`), a random
//! token known only to Postgres and the worker that claimed the attempt, and
//! it is kept only on the open attempt that holds that claim. Anything else
//! that arrives on the queue (a forgery, a malformed or oversize body) is
//! dead-lettered with the reason, and settles nothing.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::domain::{AttemptId, JobId};
use crate::edges::store::{Finished, Started, Verdict};
use crate::settings::config::Config;

/// One settlement handed on: a finished attempt's answer and the claim it
/// was started under.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Settlement {
    /// The attempt.
    pub(crate) attempt_id: AttemptId,
    /// Its job.
    pub(crate) job_id: JobId,
    /// The claim the attempt was started under.
    pub(crate) claim: Uuid,
    /// The job's version when the attempt started: the compare-and-swap's guard.
    pub(crate) version: i64,
    /// How the call ended, as its worker judged it.
    pub(crate) verdict: Verdict,
    /// What the provider reported it spent.
    pub(crate) usage: Option<Value>,
    /// The provider's response id.
    pub(crate) request_id: Option<String>,
}

impl Settlement {
    /// The settlement of `finished`, started as `started`.
    pub(crate) fn of(started: &Started, finished: &Finished) -> Settlement {
        Settlement {
            attempt_id: finished.attempt_id,
            job_id: finished.job_id,
            claim: started.claim,
            version: finished.version,
            verdict: finished.verdict.clone(),
            usage: finished.usage.clone(),
            request_id: finished.provider_request_id.clone(),
        }
    }

    /// Reads a delivery's body: a specific reason when it is too large or
    /// not a settlement.
    pub(crate) fn parse(body: &[u8], limit: usize) -> Result<Settlement, String> {
        if body.len() > limit {
            return Err(format!(
                "settlement_too_large: {} bytes, over the {limit} a settlement may take",
                body.len()
            ));
        }
        serde_json::from_slice(body).map_err(|e| format!("malformed_settlement: {e}"))
    }

    /// The finished attempt it settles.
    pub(crate) fn finished(&self) -> Finished {
        Finished {
            attempt_id: self.attempt_id,
            job_id: self.job_id,
            version: self.version,
            provider_request_id: self.request_id.clone(),
            usage: self.usage.clone(),
            verdict: self.verdict.clone(),
            // Kept only on the attempt that holds its claim: never a lost one.
            asked: None,
        }
    }
}

/// The largest settlement body a worker takes: an answer is at most its
/// provider's `max_response_bytes`, and re-encoding it as JSON can at worst
/// escape each byte into six (`\u0001`), with room for the rest of the message.
pub(crate) fn limit(config: &Config) -> usize {
    let largest = config
        .providers
        .values()
        .map(|p| p.max_response_bytes)
        .max()
        .unwrap_or(crate::settings::config::DEFAULT_MAX_RESPONSE_BYTES);
    largest.saturating_mul(6).saturating_add(64 * 1024)
}
