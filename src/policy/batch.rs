//! What follows a batch of definite failures, decided without I/O: once per
//! job, nothing for an ended job, a block lifted when no unknown is left, and
//! otherwise the caller's route rule.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::domain::{AttemptId, JobId, JobStatus};
use crate::policy::next::{FailedJob, NextStep};

/// An attempt planned after a definite failure. `not_before` is `None` when it is
/// due now: its writer publishes it at once instead of leaving it to the relay.
#[derive(Debug)]
pub(crate) struct NextAttempt {
    pub(crate) id: AttemptId,
    pub(crate) job: JobId,
    pub(crate) number: i32,
    pub(crate) provider: String,
    pub(crate) not_before: Option<DateTime<Utc>>,
}

/// What planning needs to know of a job's attempts.
#[derive(Debug)]
pub(crate) struct AttemptCounts {
    pub(crate) job_id: Uuid,
    pub(crate) made: i64,
    pub(crate) max_number: i32,
    /// Some attempt is `queued`, `started` or `unknown`.
    pub(crate) open: bool,
    /// Some attempt is `unknown`.
    pub(crate) unknown: bool,
    /// The `queued` attempts, and their providers; not those whose turn is
    /// still held (their provider's hand-out publishes them).
    pub(crate) queued: Vec<Uuid>,
    pub(crate) queued_providers: Vec<String>,
}

/// An attempt the store just marked `failed`.
#[derive(Debug)]
pub(crate) struct FailedAttempt {
    pub(crate) attempt_id: Uuid,
    pub(crate) job_id: Uuid,
    pub(crate) provider: String,
    pub(crate) error: String,
}

/// What is known of one failure beyond its row: whether another attempt may
/// follow at all, and the provider's `Retry-After`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Definite {
    pub(crate) attempt_id: AttemptId,
    pub(crate) retryable: bool,
    pub(crate) retry_after: Option<Duration>,
}

/// A failed attempt whose job was not among the locked ones: the store's rows
/// disagree with each other.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct MissingJob {
    pub(crate) attempt: Uuid,
    pub(crate) job: Uuid,
}

impl std::fmt::Display for MissingJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "attempt {} has no job {}", self.attempt, self.job)
    }
}

/// A locked job, as the planning of its failures needs it.
pub(crate) struct JobState {
    pub(crate) status: JobStatus,
    pub(crate) operation: String,
    pub(crate) counts: AttemptCounts,
}

/// What settling a batch of definite failures does, decided without I/O.
#[derive(Debug, Default)]
pub(crate) struct FailurePlan {
    /// Attempts to create.
    pub(crate) next_attempts: Vec<NextAttempt>,
    /// Jobs that fail, with their error.
    pub(crate) give_up: Vec<(Uuid, String)>,
    /// Jobs whose last unknown this batch lifted: they run again.
    pub(crate) unblocked: Vec<Uuid>,
    /// Queued attempts of those jobs to publish again: (attempt, job, provider).
    pub(crate) republish: Vec<(Uuid, Uuid, String)>,
    /// The failed attempt whose settlement created each next attempt.
    pub(crate) triggered: HashMap<Uuid, AttemptId>,
}

/// Plans what follows each failed attempt of the locked `jobs`: nothing for an ended job or one already planned in
/// this batch; for a job with another open attempt, only lifting its block when
/// no unknown is left; otherwise the caller's `plan` (the route rule). A retry
/// due at once (or any, when `immediate`) has no not-before time.
pub(crate) fn plan_failures(
    failed: &[FailedAttempt],
    jobs: &HashMap<Uuid, JobState>,
    definite: &[Definite],
    plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    immediate: bool,
    now: DateTime<Utc>,
) -> Result<FailurePlan, MissingJob> {
    let by_attempt: HashMap<Uuid, &Definite> =
        definite.iter().map(|f| (f.attempt_id.0, f)).collect();
    let mut out = FailurePlan::default();
    let mut planned: BTreeSet<Uuid> = BTreeSet::new();
    for FailedAttempt {
        attempt_id: attempt,
        job_id: job,
        provider,
        error,
    } in failed
    {
        let Some(state) = jobs.get(job) else {
            return Err(MissingJob {
                attempt: *attempt,
                job: *job,
            });
        };
        let c = &state.counts;
        if state.status.is_terminal() || !planned.insert(*job) {
            continue;
        }
        // Another open attempt (a hedge) carries on. If this failure lifted the
        // job's last unknown, the job runs again, and an attempt whose delivery
        // was turned away while it was blocked is published once more.
        if c.open {
            if state.status == JobStatus::Unknown && !c.unknown {
                out.unblocked.push(*job);
                for (id, p) in c.queued.iter().zip(&c.queued_providers) {
                    out.republish.push((*id, *job, p.clone()));
                }
            }
            continue;
        }
        let step = plan(&FailedJob {
            job_id: JobId(*job),
            operation: state.operation.clone(),
            failed_provider: provider.clone(),
            attempts_made: u32::try_from(c.made).unwrap_or(u32::MAX),
            error: error.clone(),
            retryable: by_attempt.get(attempt).is_none_or(|f| f.retryable),
            retry_after: by_attempt.get(attempt).and_then(|f| f.retry_after),
        });
        match step {
            NextStep::Retry { provider, delay } => {
                let id = AttemptId::new();
                let delay = if immediate { Duration::ZERO } else { delay };
                out.next_attempts.push(NextAttempt {
                    id,
                    job: JobId(*job),
                    number: c.max_number + 1,
                    provider,
                    not_before: (!delay.is_zero()).then(|| later(now, delay)),
                });
                out.triggered.insert(*attempt, id);
            }
            NextStep::GiveUp { error } => out.give_up.push((*job, error)),
        }
    }
    Ok(out)
}

/// `now + delay`, saturating instead of panicking: a delay comes from outside
/// (a provider's `Retry-After`, configuration) and must never crash a worker.
fn later(now: DateTime<Utc>, delay: Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(delay)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

#[cfg(test)]
mod tests {
    use super::{AttemptCounts, Definite, FailedAttempt, JobState, later, plan_failures};
    use crate::domain::{AttemptId, JobStatus};
    use crate::policy::next::{FailedJob, NextStep};
    use chrono::Utc;
    use std::collections::HashMap;
    use std::time::Duration;
    use uuid::Uuid;

    fn counts(
        job: Uuid,
        made: i64,
        open: bool,
        unknown: bool,
        queued: &[(Uuid, &str)],
    ) -> AttemptCounts {
        AttemptCounts {
            job_id: job,
            made,
            max_number: i32::try_from(made).unwrap(),
            open,
            unknown,
            queued: queued.iter().map(|q| q.0).collect(),
            queued_providers: queued.iter().map(|q| q.1.to_owned()).collect(),
        }
    }

    fn state(status: JobStatus, c: AttemptCounts) -> JobState {
        JobState {
            status,
            operation: "op".into(),
            counts: c,
        }
    }

    fn failure(attempt: Uuid) -> Definite {
        Definite {
            attempt_id: AttemptId(attempt),
            retryable: true,
            retry_after: None,
        }
    }

    fn retry_in(delay: Duration) -> impl Fn(&FailedJob) -> NextStep + Sync {
        move |_| NextStep::Retry {
            provider: "b".into(),
            delay,
        }
    }

    fn row(attempt: Uuid, job: Uuid) -> FailedAttempt {
        FailedAttempt {
            attempt_id: attempt,
            job_id: job,
            provider: "a".into(),
            error: "provider_error: HTTP 500".into(),
        }
    }

    #[test]
    fn a_failure_plans_the_next_attempt_once_per_job() {
        let (job, a1, a2) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let jobs = HashMap::from([(
            job,
            state(JobStatus::Running, counts(job, 2, false, false, &[])),
        )]);
        let now = Utc::now();
        // Two failures of one job in one batch (a hedge and its primary): one plan.
        let plan = plan_failures(
            &[row(a1, job), row(a2, job)],
            &jobs,
            &[failure(a1), failure(a2)],
            &retry_in(Duration::from_secs(5)),
            false,
            now,
        )
        .unwrap();
        assert_eq!(plan.next_attempts.len(), 1);
        let next = &plan.next_attempts[0];
        assert_eq!((next.number, next.provider.as_str()), (3, "b"));
        assert_eq!(next.not_before, Some(later(now, Duration::from_secs(5))));
        assert_eq!(plan.triggered.get(&a1), Some(&next.id));
        assert!(plan.give_up.is_empty() && plan.unblocked.is_empty());
        // An operator's resolution retries at once: no not-before time.
        let at_once = plan_failures(
            &[row(a1, job)],
            &jobs,
            &[failure(a1)],
            &retry_in(Duration::from_secs(5)),
            true,
            now,
        )
        .unwrap();
        assert_eq!(at_once.next_attempts[0].not_before, None);
    }

    #[test]
    fn nothing_is_planned_for_an_ended_job_and_giving_up_fails_it() {
        let (job, a1) = (Uuid::now_v7(), Uuid::now_v7());
        let ended = HashMap::from([(
            job,
            state(JobStatus::Cancelled, counts(job, 1, false, false, &[])),
        )]);
        let plan = plan_failures(
            &[row(a1, job)],
            &ended,
            &[failure(a1)],
            &retry_in(Duration::ZERO),
            false,
            Utc::now(),
        )
        .unwrap();
        assert!(plan.next_attempts.is_empty() && plan.give_up.is_empty());
        let running = HashMap::from([(
            job,
            state(JobStatus::Running, counts(job, 3, false, false, &[])),
        )]);
        let give_up = |f: &FailedJob| NextStep::GiveUp {
            error: f.error.clone(),
        };
        let plan = plan_failures(
            &[row(a1, job)],
            &running,
            &[failure(a1)],
            &give_up,
            false,
            Utc::now(),
        )
        .unwrap();
        assert_eq!(
            plan.give_up,
            vec![(job, "provider_error: HTTP 500".to_owned())]
        );
    }

    #[test]
    fn a_lifted_block_runs_the_job_again_and_republishes_what_waited() {
        let (job, a1, hedge) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let never = |_: &FailedJob| -> NextStep { panic!("no plan beside an open attempt") };
        // The unknown primary is resolved as failed; a hedge waits, queued.
        let blocked = HashMap::from([(
            job,
            state(
                JobStatus::Unknown,
                counts(job, 2, true, false, &[(hedge, "b")]),
            ),
        )]);
        let plan = plan_failures(
            &[row(a1, job)],
            &blocked,
            &[failure(a1)],
            &never,
            true,
            Utc::now(),
        )
        .unwrap();
        assert_eq!(plan.unblocked, vec![job]);
        assert_eq!(plan.republish, vec![(hedge, job, "b".to_owned())]);
        assert!(plan.next_attempts.is_empty());
        // Another attempt is still unknown: the job stays blocked.
        let still = HashMap::from([(
            job,
            state(
                JobStatus::Unknown,
                counts(job, 3, true, true, &[(hedge, "b")]),
            ),
        )]);
        let plan = plan_failures(
            &[row(a1, job)],
            &still,
            &[failure(a1)],
            &never,
            true,
            Utc::now(),
        )
        .unwrap();
        assert!(plan.unblocked.is_empty() && plan.republish.is_empty());
        // A running job with a hedge in flight: the hedge carries on.
        let running = HashMap::from([(
            job,
            state(JobStatus::Running, counts(job, 2, true, false, &[])),
        )]);
        let plan = plan_failures(
            &[row(a1, job)],
            &running,
            &[failure(a1)],
            &never,
            false,
            Utc::now(),
        )
        .unwrap();
        assert!(
            plan.unblocked.is_empty() && plan.next_attempts.is_empty() && plan.give_up.is_empty()
        );
    }
}
