//! Attempts this worker's own intake has just admitted
//! ([`crate::shared::runtime::own_consumers`]): taken while a call slot is free,
//! claimed through the same claim group commit as a delivery, called and
//! settled. An attempt that does not start here (its job row held, blocked,
//! taken by a delivery first, a claim that failed) is left to its message.
//! The delivery of an attempt started here is acked at once, with neither a
//! claim nor a look-up: the attempt is this worker's call. One that comes
//! while the claim here runs waits for its outcome rather than claim beside
//! it.

use std::sync::Arc;
use std::time::Duration;

use super::claim::ClaimAnswer;
use super::consumer::Consumer;
use crate::domain::AttemptId;
use crate::trace::TraceContext;

/// Tells the claim's outcome when the task that took an attempt ends
/// without telling it (cut off at a stop): not started here, so that its
/// delivery is claimed as any, and never waits for ever.
struct Claiming {
    consumer: Arc<Consumer>,
    attempt: AttemptId,
    told: bool,
}

impl Claiming {
    fn tell(&mut self, started: bool) {
        self.consumer.taken.claimed(self.attempt, started);
        self.told = true;
    }
}

impl Drop for Claiming {
    fn drop(&mut self) {
        if !self.told {
            self.consumer.taken.claimed(self.attempt, false);
        }
    }
}

impl Consumer {
    /// Takes an attempt this worker has just admitted, if a call slot is
    /// free and the worker is not stopping: claims, calls and settles it on
    /// a task of its own. False when it did not take it.
    pub(super) fn take_admitted(
        self: &Arc<Self>,
        attempt: AttemptId,
        parent: Option<TraceContext>,
    ) -> bool {
        if self.shutdown.is_triggered() {
            return false;
        }
        let Ok(slot) = self.calls.clone().try_acquire_owned() else {
            return false;
        };
        let Ok(mut local) = self.local.lock() else {
            return false;
        };
        while local.try_join_next().is_some() {}
        self.taken.claiming(attempt);
        let mut claiming = Claiming {
            consumer: self.clone(),
            attempt,
            told: false,
        };
        tracing::debug!(attempt_id = %attempt, "attempt taken on admission: claiming it");
        local.spawn(async move {
            let consumer = claiming.consumer.clone();
            let claimed = consumer.claims.submit(attempt).await;
            let Some(Ok(ClaimAnswer::Started(started, _))) = claimed else {
                claiming.tell(false);
                return;
            };
            claiming.tell(true);
            tracing::debug!(attempt_id = %attempt, "attempt started on admission");
            crate::edges::metrics::attempt_claimed_on_admission(&consumer.client.provider().name);
            if let Err(e) = consumer
                .call_and_settle(started, parent.as_ref(), slot)
                .await
            {
                tracing::error!(error = %e, attempt_id = %attempt, "an attempt claimed on admission was not settled; the sweeps settle it");
            }
        });
        true
    }

    /// Waits for the attempts taken on admission to be settled, for at most
    /// `grace`; what is left then is cut off (its call's outcome is the
    /// vanished sweep's, as a delivery's cut off at the end of the grace).
    pub(super) async fn finish_admitted(&self, grace: Duration) {
        let Ok(mut local) = self.local.lock().map(|mut l| std::mem::take(&mut *l)) else {
            return;
        };
        let drained =
            tokio::time::timeout(grace, async { while local.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            tracing::warn!(
                remaining = local.len(),
                "shutdown grace over; attempts taken on admission are cut off"
            );
            local.shutdown().await;
        }
    }
}
