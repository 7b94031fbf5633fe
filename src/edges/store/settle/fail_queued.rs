//! Attempts that never start (their message was lost for good, or their
//! reservation did not fit): failed while still `queued`, and what follows
//! planned as for any definite failure.

use crate::domain::{AttemptId, AttemptStatus};
use crate::edges::store::drafts::OutboxMessage;
use crate::edges::store::error::Result;
use crate::edges::store::handles::Settle;
use crate::edges::store::settle::{Failure, Settled};
use crate::policy::next::{FailedJob, NextStep};

impl Settle<'_> {
    /// Fails attempts that are still `queued` (their message was lost for
    /// good, or their reservation did not fit), and plans what follows each,
    /// as for any definite failure; `retryable` false when no other attempt
    /// could do better.
    pub async fn fail_queued(
        self,
        attempts: &[(AttemptId, String)],
        retryable: bool,
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<(AttemptId, Settled)>, Vec<OutboxMessage>)> {
        if attempts.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        self.0
            .retrying(|| async {
                let mut tx = self.0.pool.begin().await?;
                let failures: Vec<Failure> = attempts
                    .iter()
                    .map(|(id, error)| Failure {
                        attempt_id: *id,
                        error: error.clone(),
                        retryable,
                        retry_after: None,
                        usage: None,
                        request_id: None,
                    })
                    .collect();
                let (outcomes, drafts) = self
                    .settle_failures(
                        &mut tx,
                        &failures,
                        &[AttemptStatus::Queued],
                        plan,
                        false,
                        false,
                    )
                    .await?;
                let publish = self.0.outbox().insert(&mut tx, &drafts).await?;
                tx.commit().await?;
                Ok((outcomes, publish))
            })
            .await
    }
}
