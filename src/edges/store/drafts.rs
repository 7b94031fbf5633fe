//! What a commit writes to the outbox: attempt messages and job events, and the
//! exchanges they go to; and the rows the relay publishes.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use crate::domain::{AttemptId, JobId, JobStatus};

/// A message to publish because of a commit, written in that commit's transaction.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxDraft {
    /// The exchange.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The AMQP `message_id`; consumers deduplicate on it.
    pub message_id: String,
    /// The JSON body.
    pub body: Value,
    /// Not published before this time; `None` publishes at once, by the writer.
    pub not_before: Option<DateTime<Utc>>,
    /// The job it is about: the row takes the job's trace context.
    pub job_id: JobId,
}

/// An outbox row this process holds the lease on and should publish now.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxMessage {
    /// The row id.
    pub id: i64,
    /// The exchange.
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The AMQP `message_id`.
    pub message_id: String,
    /// The JSON body.
    pub body: Value,
    /// The job's W3C `traceparent`, for the message's headers.
    pub traceparent: Option<String>,
    /// The job's W3C `tracestate`.
    pub tracestate: Option<String>,
}

impl OutboxMessage {
    /// The trace context the message carries in its headers: the job's.
    pub fn trace(&self) -> Option<crate::trace::TraceContext> {
        crate::trace::TraceContext::parse(self.traceparent.as_deref()?, self.tracestate.as_deref())
    }
}

/// The event published when a job reaches a terminal state.
#[derive(Clone, Debug, Serialize)]
struct JobEvent<'a> {
    event_id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    job_id: JobId,
    version: i64,
    owner_id: &'a str,
    idempotency_key: &'a str,
    operation: &'a str,
    status: &'static str,
    completed_by: Option<AttemptId>,
    result: Option<&'a Value>,
    /// Its stable code and onejob's own message
    /// ([`crate::domain::public_error`]): an event goes to every subscriber,
    /// and a provider's error text (which may quote keys or tenant data) is
    /// for operators only.
    error: Option<String>,
    occurred_at: DateTime<Utc>,
}

/// Exchange and routing names the store writes into outbox rows.
#[derive(Clone, Debug)]
pub struct Routes {
    /// Where attempt messages go (`onejob`).
    pub work_exchange: String,
    /// Where job events go (`onejob.events`).
    pub events_exchange: String,
    /// How long a publisher owns a row it just wrote.
    pub lease: Duration,
    /// `[owners]`: the limits admission applies where an owner has none of
    /// its own.
    pub owners: crate::settings::config::OwnerLimits,
    /// Each provider's share: how many of one owner's turns may be handed
    /// out to its queue and not yet started ([`crate::settings::config::Provider::share`]).
    pub shares: Vec<(String, i64)>,
}

impl Routes {
    pub(super) fn attempt_draft(
        &self,
        attempt: AttemptId,
        job: JobId,
        provider: &str,
        not_before: Option<DateTime<Utc>>,
    ) -> OutboxDraft {
        OutboxDraft {
            exchange: self.work_exchange.clone(),
            routing_key: crate::broker::attempts_routing_key(provider),
            message_id: attempt.to_string(),
            body: serde_json::json!({ "attempt_id": attempt, "job_id": job }),
            not_before,
            job_id: job,
        }
    }

    fn event_draft(&self, event: &JobEvent<'_>) -> OutboxDraft {
        OutboxDraft {
            exchange: self.events_exchange.clone(),
            routing_key: event.kind.to_owned(),
            message_id: event.event_id.clone(),
            body: serde_json::to_value(event).unwrap_or(Value::Null),
            not_before: None,
            job_id: event.job_id,
        }
    }
}

/// The job columns an event needs, as returned by the statements that end a job.
pub(super) struct Ended {
    pub(super) job_id: JobId,
    pub(super) version: i64,
    pub(super) owner_id: String,
    pub(super) idempotency_key: String,
    pub(super) operation: String,
    pub(super) status: JobStatus,
    pub(super) completed_by: Option<AttemptId>,
    pub(super) result: Option<Value>,
    pub(super) error: Option<String>,
}

impl Ended {
    pub(super) fn draft(&self, routes: &Routes) -> OutboxDraft {
        let kind = match self.status {
            JobStatus::Succeeded => "job.succeeded",
            JobStatus::Failed => "job.failed",
            // Only the three terminal states end a job; the statements that
            // return an `Ended` set one of them.
            _ => "job.cancelled",
        };
        routes.event_draft(&JobEvent {
            event_id: format!("{}:{}", self.job_id, self.version),
            kind,
            job_id: self.job_id,
            version: self.version,
            owner_id: &self.owner_id,
            idempotency_key: &self.idempotency_key,
            operation: &self.operation,
            status: self.status.as_str(),
            completed_by: self.completed_by,
            result: self.result.as_ref(),
            error: self.error.as_deref().map(|stored| {
                let (code, message) = crate::domain::public_error(stored);
                format!("{code}: {message}")
            }),
            occurred_at: Utc::now(),
        })
    }
}

/// The routes the unit tests write outbox rows with.
#[cfg(test)]
pub(super) fn test_routes() -> Routes {
    Routes {
        work_exchange: "onejob".into(),
        events_exchange: "onejob.events".into(),
        lease: Duration::from_secs(30),
        owners: Default::default(),
        shares: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::Ended;
    use super::test_routes as routes;
    use crate::domain::{JobId, JobStatus};

    #[test]
    fn an_ended_job_publishes_the_event_of_its_status() {
        for (status, kind) in [
            (JobStatus::Succeeded, "job.succeeded"),
            (JobStatus::Failed, "job.failed"),
            (JobStatus::Cancelled, "job.cancelled"),
        ] {
            let job = JobId::new();
            let draft = Ended {
                job_id: job,
                version: 7,
                owner_id: "acct".into(),
                idempotency_key: "k".into(),
                operation: "op".into(),
                status,
                completed_by: None,
                result: None,
                error: Some("e".into()),
            }
            .draft(&routes());
            assert_eq!(draft.routing_key, kind);
            assert_eq!(draft.message_id, format!("{job}:7"));
            assert_eq!(draft.body["status"], status.as_str());
            assert_eq!(draft.body["type"], kind);
            assert_eq!(draft.not_before, None, "events go out at once");
        }
    }

    #[test]
    fn an_event_says_no_more_than_the_gateway_of_why_a_job_failed() {
        let draft = Ended {
            job_id: JobId::new(),
            version: 3,
            owner_id: "acct".into(),
            idempotency_key: "k".into(),
            operation: "op".into(),
            status: JobStatus::Failed,
            completed_by: None,
            result: None,
            error: Some(
                r#"provider_error: HTTP 401: {"error":"bad key sk-123 for tenant x"}"#.into(),
            ),
        }
        .draft(&routes());
        assert_eq!(
            draft.body["error"],
            "provider_error: the provider refused the request"
        );
    }
}
