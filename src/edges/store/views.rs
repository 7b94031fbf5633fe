//! Jobs, attempts and gateway tokens as operators see them.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::domain::{AttemptId, AttemptStatus, JobId, JobStatus};

/// A job as operators see it.
#[derive(Clone, Debug, Serialize)]
pub struct JobView {
    /// The job id.
    pub id: JobId,
    /// Owner.
    pub owner_id: String,
    /// Idempotency key.
    pub idempotency_key: String,
    /// Fingerprint of the intent.
    pub request_fingerprint: String,
    /// Operation.
    pub operation: String,
    /// Input.
    pub input: Value,
    /// The pinned provider, if any.
    pub provider: Option<String>,
    /// Status.
    pub status: JobStatus,
    /// Version.
    pub version: i64,
    /// The winning attempt.
    pub completed_by: Option<AttemptId>,
    /// Result.
    pub result: Option<Value>,
    /// Error.
    pub error: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
    /// Its attempts, by number.
    pub attempts: Vec<AttemptView>,
}

/// A `jobs` row, as the view queries read it; [`JobRow::with`] adds its attempts.
pub(super) struct JobRow {
    pub(super) id: JobId,
    pub(super) owner_id: String,
    pub(super) idempotency_key: String,
    pub(super) request_fingerprint: String,
    pub(super) operation: String,
    pub(super) input: Value,
    pub(super) provider: Option<String>,
    pub(super) status: JobStatus,
    pub(super) version: i64,
    pub(super) completed_by: Option<AttemptId>,
    pub(super) result: Option<Value>,
    pub(super) error: Option<String>,
    pub(super) created_at: DateTime<Utc>,
    pub(super) updated_at: DateTime<Utc>,
}

impl JobRow {
    pub(super) fn with(self, attempts: Vec<AttemptView>) -> JobView {
        JobView {
            id: self.id,
            owner_id: self.owner_id,
            idempotency_key: self.idempotency_key,
            request_fingerprint: self.request_fingerprint,
            operation: self.operation,
            input: self.input,
            provider: self.provider,
            status: self.status,
            version: self.version,
            completed_by: self.completed_by,
            result: self.result,
            error: self.error,
            created_at: self.created_at,
            updated_at: self.updated_at,
            attempts,
        }
    }
}

/// A gateway token as operators see it: never the secret.
#[derive(Clone, Debug, Serialize)]
pub struct TokenView {
    /// The token's id.
    pub id: Uuid,
    /// Whose jobs it reaches.
    pub owner_id: String,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it was revoked, if it was.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// An attempt as operators see it.
#[derive(Clone, Debug, Serialize)]
pub struct AttemptView {
    /// The attempt id.
    pub id: AttemptId,
    /// Its job.
    pub job_id: JobId,
    /// Its number within the job.
    pub number: i32,
    /// Provider.
    pub provider: String,
    /// Status.
    pub status: AttemptStatus,
    /// Error.
    pub error: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Not published before.
    pub not_before: DateTime<Utc>,
    /// Held in the database, waiting its turn: its owner has its share of
    /// the provider's queue out, or its `max_in_flight` in flight.
    pub held: bool,
    /// Started.
    pub started_at: Option<DateTime<Utc>>,
    /// Finished.
    pub finished_at: Option<DateTime<Utc>>,
    /// The provider's response id.
    pub provider_request_id: Option<String>,
    /// What the provider reported it spent.
    pub usage: Option<Value>,
    /// Looks taken at the provider's evidence while it was `unknown`.
    pub evidence_looks: i32,
    /// When the last look ended.
    pub evidence_last_at: Option<DateTime<Utc>>,
    /// What the last look found.
    pub evidence_note: Option<String>,
    /// When the next look may come.
    pub evidence_next_at: Option<DateTime<Utc>>,
}
