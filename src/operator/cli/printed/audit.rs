//! An audit row as `jobs show --json` prints it.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::edges::store::AuditEntry;

/// One audit row: who did what, when, why, and what came of it.
#[derive(Debug, Serialize)]
pub(in crate::operator::cli) struct Audit {
    id: Uuid,
    at: DateTime<Utc>,
    actor: String,
    action: String,
    job_id: Option<Uuid>,
    attempt_id: Option<Uuid>,
    target: Option<String>,
    reason: String,
    detail: Value,
}

impl From<&AuditEntry> for Audit {
    fn from(e: &AuditEntry) -> Audit {
        Audit {
            id: e.id,
            at: e.at,
            actor: e.actor.clone(),
            action: e.action.clone(),
            job_id: e.job_id,
            attempt_id: e.attempt_id,
            target: e.target.clone(),
            reason: e.reason.clone(),
            detail: e.detail.clone(),
        }
    }
}
