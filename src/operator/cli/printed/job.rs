//! Jobs as `jobs show|find|cancel --json` print them (with their attempts),
//! and as `jobs list --json` lists them (their attempts counted).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use super::audit::Audit;
use super::owner::Owner;
use crate::domain::{AttemptId, AttemptStatus, JobId, JobStatus};
use crate::edges::store::{AttemptView, AuditEntry, JobSummary, JobView, OwnerView};

/// A job and its attempts, by number.
#[derive(Debug, Serialize)]
pub(in crate::operator::cli) struct Job {
    id: JobId,
    owner_id: String,
    idempotency_key: String,
    request_fingerprint: String,
    operation: String,
    input: Value,
    provider: Option<String>,
    status: JobStatus,
    version: i64,
    completed_by: Option<AttemptId>,
    result: Option<Value>,
    error: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    attempts: Vec<Attempt>,
}

/// `jobs show --json`: the job, its owner's limits and its audit rows.
#[derive(Debug, Serialize)]
pub(in crate::operator::cli) struct Shown {
    #[serde(flatten)]
    job: Job,
    audit: Vec<Audit>,
    owner_limits: Owner,
}

impl Shown {
    pub(in crate::operator::cli) fn of(
        job: &JobView,
        owner: &OwnerView,
        audit: &[AuditEntry],
    ) -> Shown {
        Shown {
            job: job.into(),
            audit: audit.iter().map(Audit::from).collect(),
            owner_limits: owner.into(),
        }
    }
}

/// One attempt: one call to one provider, and what is known of it.
#[derive(Debug, Serialize)]
struct Attempt {
    id: AttemptId,
    job_id: JobId,
    number: i32,
    provider: String,
    status: AttemptStatus,
    error: Option<String>,
    created_at: DateTime<Utc>,
    not_before: DateTime<Utc>,
    held: bool,
    started_at: Option<DateTime<Utc>>,
    finished_at: Option<DateTime<Utc>>,
    provider_request_id: Option<String>,
    usage: Option<Value>,
    evidence_looks: i32,
    evidence_last_at: Option<DateTime<Utc>>,
    evidence_note: Option<String>,
    evidence_next_at: Option<DateTime<Utc>>,
}

/// A job as listed: what `jobs show` gives but its input, result and
/// attempts, which it counts.
#[derive(Debug, Serialize)]
pub(in crate::operator::cli) struct Listed {
    id: JobId,
    owner_id: String,
    idempotency_key: String,
    request_fingerprint: String,
    operation: String,
    provider: Option<String>,
    status: JobStatus,
    version: i64,
    completed_by: Option<AttemptId>,
    error: Option<String>,
    attempt_count: i64,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl From<&JobView> for Job {
    fn from(j: &JobView) -> Job {
        Job {
            id: j.id,
            owner_id: j.owner_id.clone(),
            idempotency_key: j.idempotency_key.clone(),
            request_fingerprint: j.request_fingerprint.clone(),
            operation: j.operation.clone(),
            input: j.input.clone(),
            provider: j.provider.clone(),
            status: j.status,
            version: j.version,
            completed_by: j.completed_by,
            result: j.result.clone(),
            error: j.error.clone(),
            created_at: j.created_at,
            updated_at: j.updated_at,
            attempts: j.attempts.iter().map(Attempt::from).collect(),
        }
    }
}

impl From<&AttemptView> for Attempt {
    fn from(a: &AttemptView) -> Attempt {
        Attempt {
            id: a.id,
            job_id: a.job_id,
            number: a.number,
            provider: a.provider.clone(),
            status: a.status,
            error: a.error.clone(),
            created_at: a.created_at,
            not_before: a.not_before,
            held: a.held,
            started_at: a.started_at,
            finished_at: a.finished_at,
            provider_request_id: a.provider_request_id.clone(),
            usage: a.usage.clone(),
            evidence_looks: a.evidence_looks,
            evidence_last_at: a.evidence_last_at,
            evidence_note: a.evidence_note.clone(),
            evidence_next_at: a.evidence_next_at,
        }
    }
}

impl From<&JobSummary> for Listed {
    fn from(j: &JobSummary) -> Listed {
        Listed {
            id: j.id,
            owner_id: j.owner_id.clone(),
            idempotency_key: j.idempotency_key.clone(),
            request_fingerprint: j.request_fingerprint.clone(),
            operation: j.operation.clone(),
            provider: j.provider.clone(),
            status: j.status,
            version: j.version,
            completed_by: j.completed_by,
            error: j.error.clone(),
            attempt_count: j.attempt_count,
            created_at: j.created_at,
            updated_at: j.updated_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::config::{OwnerLimits, OwnerOverrides};

    fn keys(value: &Value) -> Vec<String> {
        let mut keys: Vec<String> = value
            .as_object()
            .expect("an object")
            .keys()
            .cloned()
            .collect();
        keys.sort();
        keys
    }

    fn job() -> JobView {
        let now = Utc::now();
        let id = JobId::new();
        JobView {
            id,
            owner_id: "o".into(),
            idempotency_key: "k".into(),
            request_fingerprint: "f".into(),
            operation: "op".into(),
            input: serde_json::json!({"text": "hi"}),
            provider: None,
            status: JobStatus::Running,
            version: 2,
            completed_by: None,
            result: None,
            error: None,
            created_at: now,
            updated_at: now,
            attempts: vec![AttemptView {
                id: AttemptId::new(),
                job_id: id,
                number: 1,
                provider: "p".into(),
                status: AttemptStatus::Started,
                error: None,
                created_at: now,
                not_before: now,
                held: false,
                started_at: Some(now),
                finished_at: None,
                provider_request_id: None,
                usage: None,
                evidence_looks: 0,
                evidence_last_at: None,
                evidence_note: None,
                evidence_next_at: None,
            }],
        }
    }

    fn owner() -> OwnerView {
        OwnerView {
            owner_id: "o".into(),
            own: OwnerOverrides::default(),
            limits: OwnerLimits::default(),
            spent_24h: 0,
            reserved: 0,
            left: None,
            waiting: 0,
            updated_at: None,
        }
    }

    /// What `jobs show --json` prints is the CLI's own shape, field by field
    /// (docs/src/reference/cli.md): programs read it, so it changes only here.
    #[test]
    fn jobs_show_prints_its_own_fields_and_no_others() {
        let shown = serde_json::to_value(Shown::of(&job(), &owner(), &[])).unwrap();
        assert_eq!(
            keys(&shown),
            [
                "attempts",
                "audit",
                "completed_by",
                "created_at",
                "error",
                "id",
                "idempotency_key",
                "input",
                "operation",
                "owner_id",
                "owner_limits",
                "provider",
                "request_fingerprint",
                "result",
                "status",
                "updated_at",
                "version",
            ]
        );
        assert_eq!(
            keys(&shown["attempts"][0]),
            [
                "created_at",
                "error",
                "evidence_last_at",
                "evidence_looks",
                "evidence_next_at",
                "evidence_note",
                "finished_at",
                "held",
                "id",
                "job_id",
                "not_before",
                "number",
                "provider",
                "provider_request_id",
                "started_at",
                "status",
                "usage",
            ]
        );
        assert_eq!(
            keys(&shown["owner_limits"]),
            [
                "left",
                "limits",
                "own",
                "owner_id",
                "reserved",
                "spent_24h",
                "updated_at",
                "waiting"
            ]
        );
        assert_eq!(
            keys(&shown["owner_limits"]["limits"]),
            ["burst", "daily_tokens", "max_in_flight", "rate"]
        );
        assert_eq!(shown["status"], "running");
        assert_eq!(shown["attempts"][0]["status"], "started");
    }
}
