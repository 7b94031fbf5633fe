//! The receipt intake publishes to an intent's `reply_to` (contract section 4).

use serde::{Deserialize, Serialize};

use super::RejectReason;
use crate::domain::JobId;

/// What intake made of an intent (contract section 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The first intent with this identity: a new job.
    Created,
    /// Same identity, same fingerprint: the existing job.
    Duplicate,
    /// Same identity, different fingerprint: nothing handed out, nothing changed.
    Conflict,
    /// Not a valid intent.
    Rejected,
}

impl Outcome {
    /// The outcome as the receipt spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Created => "created",
            Outcome::Duplicate => "duplicate",
            Outcome::Conflict => "conflict",
            Outcome::Rejected => "rejected",
        }
    }
}

/// The receipt published to an intent's `reply_to`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    /// What intake made of the intent.
    pub outcome: Outcome,
    /// The job, for `created` and `duplicate`; `null` otherwise.
    pub job_id: Option<JobId>,
    /// Why, for `rejected`; `null` otherwise.
    pub error: Option<String>,
}

impl Receipt {
    /// A receipt naming a job.
    pub fn for_job(outcome: Outcome, job_id: JobId) -> Self {
        Self {
            outcome,
            job_id: Some(job_id),
            error: None,
        }
    }

    /// A `conflict` receipt: the existing job is not handed out.
    pub fn conflict() -> Self {
        Self {
            outcome: Outcome::Conflict,
            job_id: None,
            error: None,
        }
    }

    /// A `rejected` receipt with its reason.
    pub fn rejected(reason: &RejectReason) -> Self {
        Self {
            outcome: Outcome::Rejected,
            job_id: None,
            error: Some(reason.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receipts_serialise_as_the_contract_shows() {
        let r = Receipt::conflict();
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"outcome": "conflict", "job_id": null, "error": null})
        );
    }
}
