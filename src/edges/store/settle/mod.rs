//! Attempts: the guarded start, and settling finished attempts (the
//! compare-and-swap, unknowns, definite failures and what follows them),
//! operators' resolutions and lost attempts.
//!
//! | file | holds |
//! |---|---|
//! | `claim` | the guarded start: queued attempts claimed, and handed back |
//! | `finalize` | settling a flush of finished attempts, each apart when Postgres refuses it |
//! | `compare_and_swap` | successes: one attempt per job wins, the others are discarded |
//! | `unknown` | timeouts: the attempt is `unknown` and blocks its job |
//! | `failures` | definite failures written: attempts failed, next attempts, jobs failed |
//! | `plan` | what follows a batch of definite failures, decided without I/O |
//! | `resolve` | an operator's resolution of an open attempt |
//! | `fail_queued` | attempts whose message was lost for good |
//!
//! This file holds the words a settlement is told in and answers with.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::domain::{AttemptId, JobId};
use crate::settings::config::EvidenceKind;

mod claim;
mod compare_and_swap;
mod fail_queued;
mod failures;
mod finalize;
mod resolve;
mod unknown;

pub(super) use finalize::take_rows;
pub(super) use unknown::{Timeout, mark_unknown};

/// An attempt this worker has just moved `queued → started`.
#[derive(Clone, Debug)]
pub struct Started {
    /// The attempt.
    pub attempt_id: AttemptId,
    /// Its job.
    pub job_id: JobId,
    /// Its number within the job.
    pub number: i32,
    /// The job's version when the attempt started: the compare-and-swap's guard.
    pub version: i64,
    /// The job's operation.
    pub operation: String,
    /// The job's input.
    pub input: serde_json::Map<String, Value>,
    /// The claim it was started under (`attempts.claim`): random, and known
    /// only to Postgres and the worker that claimed it, so a settlement handed
    /// on through the broker proves by it that it comes from that worker.
    pub claim: Uuid,
}

/// How an attempt ended, as its worker saw it.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum Verdict {
    /// A valid answer.
    Succeeded(Value),
    /// A definite failure. `retryable` is false when no provider could do better
    /// (the input does not render, say).
    Failed {
        /// Why.
        error: String,
        /// Whether another attempt may follow.
        retryable: bool,
        /// How long the provider asked to be left alone (HTTP 429 `Retry-After`).
        retry_after: Option<Duration>,
    },
    /// The outcome is not known: a timeout, or a connection lost after sending.
    Unknown {
        /// Why.
        error: String,
    },
}

/// One finished call, to be settled.
#[derive(Clone, Debug)]
pub struct Finished {
    /// The attempt.
    pub attempt_id: AttemptId,
    /// Its job.
    pub job_id: JobId,
    /// The job version read when the attempt started.
    pub version: i64,
    /// The provider's response id, if it answered.
    pub provider_request_id: Option<String>,
    /// What the provider reported it spent, if it answered.
    pub usage: Option<Value>,
    /// The outcome.
    pub verdict: Verdict,
    /// The evidence its call asked the provider for, where the settler made
    /// the call. The claim recorded it on the attempt; a timeout that finds
    /// its claim lost (and the record with it) records it again, so that
    /// evidence, not only an operator, can settle that unknown.
    pub asked: Option<EvidenceKind>,
}

#[cfg(test)]
impl Finished {
    /// A finished call of a new attempt, to be filled in: no answer, its
    /// outcome not yet known.
    pub(crate) fn blank() -> Finished {
        Finished {
            attempt_id: AttemptId::new(),
            job_id: JobId::new(),
            version: 1,
            provider_request_id: None,
            usage: None,
            verdict: Verdict::Unknown {
                error: String::new(),
            },
            asked: None,
        }
    }
}

/// What settling one finished attempt did.
#[derive(Clone, Debug, PartialEq)]
pub enum Settled {
    /// Its result won the compare-and-swap and is the job's result.
    Won,
    /// Another attempt had already won, or the job had ended: dropped.
    Discarded {
        /// The attempt whose result is the job's, if any.
        winner: Option<AttemptId>,
    },
    /// A definite failure; a next attempt may have been scheduled.
    Failed {
        /// The next attempt, if one was created.
        next: Option<AttemptId>,
        /// Whether the job failed for good.
        job_failed: bool,
    },
    /// The attempt and its job are now `unknown`.
    Unknown,
    /// The attempt was no longer open (resolved out-of-band): nothing changed.
    Stale,
    /// Postgres refused to store this settlement (its data, not an outage):
    /// nothing of it was written, and the settlements batched with it were
    /// written without it.
    Refused {
        /// Postgres's reason.
        error: String,
    },
    /// Its job or attempt row was held under someone else's lock (or the
    /// database timed the settlement out): nothing of it was written, the
    /// settlements batched with it were written without it, and it is to be
    /// settled again later, never dropped.
    Busy,
}

/// What one claim statement did with the attempts it was given.
#[derive(Clone, Debug, Default)]
pub struct Claim {
    /// The attempts it moved `queued → started` (or had moved, when the same
    /// claim runs again after its reply was lost).
    pub started: Vec<Started>,
    /// Queued attempts whose job row was held under someone else's lock: not
    /// started, to be claimed again later.
    pub busy: Vec<AttemptId>,
    /// Queued attempts of owners with a budget that hold no reservation: not
    /// started; they reserve ([`Owners::reserve`](crate::edges::store::Owners::reserve)) and are claimed again.
    pub unreserved: Vec<Unreserved>,
}

/// A queued attempt that must reserve of its owner's budget before it starts,
/// with what its reservation is counted from.
#[derive(Clone, Debug)]
pub struct Unreserved {
    /// The attempt.
    pub attempt_id: AttemptId,
    /// Its job.
    pub job_id: JobId,
    /// The job's owner.
    pub owner_id: String,
    /// The job's operation.
    pub operation: String,
    /// The job's input.
    pub input: serde_json::Map<String, Value>,
}

/// How an operator resolves an open attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// A definite failure: the route rule picks the next attempt.
    Failed,
    /// Ended out-of-band: the job is cancelled with it.
    Cancelled,
}

/// One definite failure to settle.
struct Failure {
    attempt_id: AttemptId,
    error: String,
    retryable: bool,
    retry_after: Option<Duration>,
    usage: Option<Value>,
    request_id: Option<String>,
}
