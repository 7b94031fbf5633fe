//! All SQL lives here, one file per aggregate: `admission`, `jobs` (views,
//! cancellation), `settle` (starting and settling attempts), `outbox`, `sweeps`
//! (what the reconciler asks), `owners` (limits and spend), `tokens`,
//! `qualifications` and `gauges`. What
//! they share has files of its own: `error` (failures and refusals), `drafts`
//! (the outbox rows a commit writes), `views` (rows as operators see them),
//! `connect` (the connection and migrations) and `retry` (transient errors run
//! again); this file holds the store itself and the types left to share.
//!
//! Every state change is one guarded statement (`UPDATE … WHERE status = …`, the
//! compare-and-swap `WHERE version = $v AND completed_by IS NULL`), so two workers
//! that both believe they own a row cannot both act: the one that changes zero rows
//! backs off. Every entry point takes a slice and settles all of it with constant
//! SQL text over `UNNEST` arrays, so batching is a caller's choice, not a rewrite.
//! Settlements take locks attempts first, then jobs, so that concurrent batches do
//! not deadlock one another. A few statements must decide under the job's lock
//! before they touch its attempts (`start`, `cancel`, and the clean-up after a
//! win), so they take the job first; against a settlement of the same job that
//! can deadlock, which Postgres detects, and the loser's transaction is retried
//! whole, as is any deadlock or serialization failure.

use sqlx::PgPool;

use crate::domain::{AttemptId, JobId};
use crate::intent::{Fingerprint, Intent};

/// The migrations, embedded in every binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

mod admission;
mod audit;
mod budget;
mod connect;
mod drafts;
mod error;
mod evidence;
mod gauges;
mod handles;
mod held;
mod job_pages;
mod jobs;
mod kept;
mod next_turns;
mod outbox;
mod overview;
mod owners;
mod qualifications;
mod replication;
mod retention;
mod retry;
mod sessions;
mod settle;
mod sweeps;
mod tokens;
mod turns;
mod views;

pub use audit::{Action, Actor, AuditEntry};
pub use budget::Reservation;
pub use drafts::{OutboxDraft, OutboxMessage, Routes};
pub use error::{Refusal, Result, StoreError};
pub use evidence::{EvidenceClaim, EvidenceDue};
pub use handles::{
    Admissions, Audit, Evidence, Jobs, Kept, Outbox, Owners, Pruning, Qualifications, Sessions,
    Settle, Sweeps, Tokens, Turns,
};
pub use held::HeldTurns;
pub use job_pages::{JobFilter, JobLine, JobMessage};
pub use jobs::{JobQuery, JobSummary};
pub use kept::{HandedOn, KeptWaiting};
pub use overview::{Overview, Unknown};
pub use owners::{OwnerChange, OwnerView};
pub use qualifications::QualificationRun;
pub use retention::{Pass, Policy, Pruned};
pub use sessions::Session;
pub use settle::{Claim, Finished, Resolution, Settled, Started, Unreserved, Verdict};
pub use tokens::OperatorTokenView;
pub use turns::HandOut;
pub use views::{AttemptView, JobView, TokenView};

/// One intent ready to become a job.
#[derive(Clone, Debug)]
pub struct NewJob {
    /// The id the job gets if it is created.
    pub job_id: JobId,
    /// The id its first attempt gets.
    pub attempt_id: AttemptId,
    /// The validated intent.
    pub intent: Intent,
    /// Its fingerprint.
    pub fingerprint: Fingerprint,
    /// The first attempt's provider.
    pub provider: String,
    /// The intake's span for it: the trace the job's messages carry.
    pub trace: Option<crate::trace::TraceContext>,
    /// The tokens its first attempt reserves if its owner has a budget: its
    /// prompt's tokens plus its operation's `max_tokens`
    /// ([`crate::shared::runtime::reservation`]).
    pub reserve: i64,
}

/// What became of one intent.
#[derive(Clone, Debug, PartialEq)]
pub enum Admission {
    /// A new job and its first attempt.
    Created {
        /// The job.
        job_id: JobId,
        /// The attempt message to publish now; `None` when the owner's rate
        /// holds it back (the relay publishes it when it is due).
        publish: Option<OutboxMessage>,
    },
    /// The identity exists with the same fingerprint.
    Duplicate {
        /// The existing job.
        job_id: JobId,
    },
    /// The identity exists with another fingerprint.
    Conflict,
    /// A new identity refused at admission: its owner is over its daily budget
    /// (`budget_exceeded`).
    Refused(crate::intent::RejectReason),
}

/// A job the reconciler may hedge: its only attempt has run past `hedge_after`.
#[derive(Clone, Debug, PartialEq)]
pub struct HedgeCandidate {
    /// The job.
    pub job_id: JobId,
    /// The provider of its running attempt.
    pub provider: String,
    /// Its operation.
    pub operation: String,
    /// How many attempts it has made.
    pub attempts_made: u32,
}

/// The Postgres side of onejob.
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
    /// The statements every job runs: admission, claims, settlements and
    /// outbox marks, on sessions that plan each statement once (see
    /// `connect.rs`).
    per_job: PgPool,
    routes: Routes,
}
