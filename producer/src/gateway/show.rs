//! `GET /v1/jobs/{id}`: a job as its owner sees it; another owner's job is not
//! found.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use onejob::domain::JobId;
use serde::Serialize;

use super::Gateway;
use super::answers::{overloaded, problem, unavailable};
use super::bearer::owner;

pub(super) async fn show_job(
    State(gateway): State<Arc<Gateway>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Ok(_permit) = gateway.in_flight.try_acquire() else {
        return overloaded();
    };
    let owner = match owner(&gateway, &headers).await {
        Ok(o) => o,
        Err(response) => return response,
    };
    let not_found = || problem(StatusCode::NOT_FOUND, format!("not_found: no job {id}"));
    let Ok(job_id) = id.parse::<uuid::Uuid>() else {
        return not_found();
    };
    // Another owner's job is not found, so ids reveal nothing.
    match gateway.store.jobs().owned_job(JobId(job_id), &owner).await {
        Ok(Some(job)) => (StatusCode::OK, axum::Json(PublicJob::from(job))).into_response(),
        Ok(None) => not_found(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read a job");
            unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable: the database cannot be reached; retry".into(),
            )
        }
    }
}

/// A job as its owner sees it through the gateway.
#[derive(Debug, Serialize)]
struct PublicJob {
    id: JobId,
    owner_id: String,
    idempotency_key: String,
    operation: String,
    input: serde_json::Value,
    provider: Option<String>,
    status: onejob::domain::JobStatus,
    version: i64,
    result: Option<serde_json::Value>,
    error: Option<PublicError>,
    created_at: chrono::DateTime<chrono::Utc>,
    updated_at: chrono::DateTime<chrono::Utc>,
    attempts: Vec<PublicAttempt>,
}

/// Why a job failed or was cancelled, as its owner sees it: a stable code and a
/// message written by onejob. The provider's own error text (status lines, body
/// excerpts) is for operators only (`onejob jobs show`).
#[derive(Debug, PartialEq, Serialize)]
struct PublicError {
    code: &'static str,
    message: &'static str,
}

impl PublicError {
    /// The owner's view of a stored error ([`onejob::domain::public_error`]).
    fn of(stored: &str) -> PublicError {
        let (code, message) = onejob::domain::public_error(stored);
        PublicError { code, message }
    }
}

/// An attempt as the job's owner sees it: when and where, and how it ended.
#[derive(Debug, Serialize)]
struct PublicAttempt {
    number: i32,
    provider: String,
    status: onejob::domain::AttemptStatus,
    created_at: chrono::DateTime<chrono::Utc>,
    /// The earliest it may be handed to its provider: its turn under the
    /// owner's rate (a first attempt), or a retry's backoff.
    not_before: chrono::DateTime<chrono::Utc>,
    /// Held in the database, waiting its turn (fair sharing, `max_in_flight`).
    held: bool,
    started_at: Option<chrono::DateTime<chrono::Utc>>,
    finished_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl From<onejob::edges::store::JobView> for PublicJob {
    fn from(job: onejob::edges::store::JobView) -> Self {
        PublicJob {
            id: job.id,
            owner_id: job.owner_id,
            idempotency_key: job.idempotency_key,
            operation: job.operation,
            input: job.input,
            provider: job.provider,
            status: job.status,
            version: job.version,
            result: job.result,
            error: job.error.as_deref().map(PublicError::of),
            created_at: job.created_at,
            updated_at: job.updated_at,
            attempts: job
                .attempts
                .into_iter()
                .map(|a| PublicAttempt {
                    number: a.number,
                    provider: a.provider,
                    status: a.status,
                    created_at: a.created_at,
                    not_before: a.not_before,
                    held: a.held,
                    started_at: a.started_at,
                    finished_at: a.finished_at,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PublicError;

    #[test]
    fn stored_errors_become_stable_codes() {
        let e = PublicError::of(r#"provider_error: HTTP 401: {"error":"bad key sk-123"}"#);
        assert_eq!(e.code, "provider_error");
        assert!(!e.message.contains("401"));
        assert_eq!(
            PublicError::of(
                "no_qualified_provider: no provider …; last error: provider_error: HTTP 500"
            )
            .code,
            "no_qualified_provider"
        );
        assert_eq!(
            PublicError::of("dead_lettered: delivery_limit (see q)").code,
            "attempt_lost"
        );
        assert_eq!(
            PublicError::of("cancelled: by an operator").code,
            "cancelled"
        );
        assert_eq!(PublicError::of("something new").code, "failed");
    }
}
