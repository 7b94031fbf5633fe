//! One provider's consumer: a delivery takes a call slot, is claimed with
//! its neighbours, called, and settled; held rows are tried again after a
//! growing pause.

use std::sync::Arc;

use lapin::message::Delivery;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

use super::call::call;
use super::claim::{ClaimAnswer, Claimed};
use super::settle::Committed;
use crate::domain::{AttemptId, AttemptMessage, AttemptStatus, JobStatus};
use crate::edges::provider::Client;
use crate::edges::shutdown::Shutdown;
use crate::edges::store::{Finished, Started};
use crate::shared::runtime::{self, Context, GroupCommit, Result, WorkerError, with_retries};
use crate::trace::TraceContext;

/// The longest pause between two tries of a claim or settlement whose rows
/// are held: the wait grows from [`HELD_PAUSE_MIN`] to this.
pub(super) const HELD_PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(2);
pub(super) const HELD_PAUSE_MIN: std::time::Duration = std::time::Duration::from_millis(50);

/// What every delivery of one provider's consumer shares.
pub(super) struct Consumer {
    pub(super) ctx: Context,
    pub(super) shutdown: Shutdown,
    pub(super) client: Arc<Client>,
    pub(super) queue: String,
    pub(super) calls: Arc<Semaphore>,
    pub(super) claims: GroupCommit<AttemptId, Claimed>,
    pub(super) settlements: GroupCommit<(Started, Finished), Committed>,
    /// The attempts started on admission whose deliveries have not come.
    pub(super) taken: super::taken::Taken,
    /// The tasks of the attempts taken on admission.
    pub(super) local: std::sync::Mutex<tokio::task::JoinSet<()>>,
}

impl Consumer {
    /// One delivery, from its call slot to its ack (or its return to the queue).
    pub(super) async fn handle(&self, delivery: Delivery) {
        // The ack only once the work is done: a delivery whose work failed is
        // returned, never acked.
        let done = match self.work(&delivery).await {
            Ok(()) => crate::edges::metrics::timed("attempt_ack", runtime::ack(&delivery)).await,
            Err(e) => Err(e),
        };
        if let Err(e) = done {
            tracing::error!(error = %e, "attempt not settled; returning it to the queue");
            runtime::requeue(&delivery).await;
        }
    }

    async fn work(&self, delivery: &Delivery) -> Result<()> {
        let message: AttemptMessage = match serde_json::from_slice(&delivery.data) {
            Ok(m) => m,
            Err(e) => {
                let reason = format!("malformed_attempt_message: {e}");
                return self.dead_letter(delivery, &reason).await;
            }
        };
        // Started by this worker on admission: its call is under way here.
        if self.taken.started_here(message.attempt_id).await {
            tracing::debug!(attempt_id = %message.attempt_id, "attempt started on admission: its delivery is dropped");
            return Ok(());
        }
        let waiting =
            crate::edges::metrics::timed("attempt_slot_wait", self.calls.clone().acquire_owned());
        let Ok(slot) = waiting.await else {
            return Err(WorkerError::Unsettled("the call slots closed".into()));
        };
        // A stopping worker starts nothing new: what waited for a slot goes back.
        if self.shutdown.is_triggered() {
            return Err(WorkerError::Unsettled(
                "the worker is stopping before this attempt started".into(),
            ));
        }
        let Some(started) = self.claim(message.attempt_id).await? else {
            drop(slot);
            return self.not_started(delivery, &message).await;
        };
        let parent = TraceContext::from_headers(delivery.properties.headers().as_ref());
        self.call_and_settle(started, parent.as_ref(), slot).await
    }

    /// Calls a started attempt's provider under its call slot (`slot`, freed
    /// once the call is over), and settles what it said.
    pub(super) async fn call_and_settle(
        &self,
        started: Started,
        parent: Option<&TraceContext>,
        slot: OwnedSemaphorePermit,
    ) -> Result<()> {
        // The attempt's span: a child of the job's, as its message names it.
        let (span, trace) = crate::edges::telemetry::hop(parent, || {
            tracing::info_span!(
                "attempt",
                otel.kind = "client",
                attempt_id = %started.attempt_id,
                job_id = %started.job_id,
                provider = %self.client.provider().name,
            )
        });
        let finished = crate::edges::metrics::timed(
            "attempt_call",
            call(&self.ctx.config, &self.client, &started, &trace).instrument(span),
        )
        .await;
        drop(slot);
        self.settle(started, finished).await
    }

    /// Claims the attempt through the claim group commit. While its job row
    /// is held under someone else's lock it waits and claims again (the
    /// delivery stays with this worker meanwhile); `None` when it did not start.
    async fn claim(&self, attempt: AttemptId) -> Result<Option<Started>> {
        let mut pause = HELD_PAUSE_MIN;
        loop {
            let claimed = self.claims.submit(attempt).await;
            match claimed.unwrap_or_else(|| Err("the claims stopped".into())) {
                Ok(ClaimAnswer::Started(started, _)) => return Ok(Some(started)),
                Ok(ClaimAnswer::NotStarted) => return Ok(None),
                Ok(ClaimAnswer::Busy) => {}
                Err(e) => return Err(WorkerError::Unsettled(e)),
            }
            tracing::debug!(attempt_id = %attempt, "attempt's job row is held under another lock; claiming it again shortly");
            self.pause(&mut pause).await.map_err(|()| {
                WorkerError::Unsettled(
                    "the worker is stopping while this attempt's job row is held".into(),
                )
            })?;
        }
    }

    /// Settles a finished call through the settle group commit. An answer is
    /// kept until it is settled: while its rows are held under someone else's
    /// lock it waits and settles again. The flush has written the answer onto
    /// its attempt the first time it had to wait, and does before anything
    /// could hand its delivery back (a failed flush), so that the reconciler
    /// settles it if this worker stops ([`crate::edges::store::Kept::keep_answer`]).
    ///
    /// The answers waiting this way are bounded by the consumer's prefetch
    /// (`attempt_prefetch`): each holds its delivery, so at the bound the
    /// consumer takes no new delivery, and no new call is made, until the
    /// database lets settlements through again.
    ///
    /// At a stop it settles once more: that flush, seeing the stop, hands an
    /// answer it can neither settle nor keep on through the broker
    /// ([`crate::shared::handed_on`]).
    async fn settle(&self, started: Started, finished: Finished) -> Result<()> {
        let mut pause = HELD_PAUSE_MIN;
        let mut stopping = false;
        loop {
            let committed = self
                .settlements
                .submit((started.clone(), finished.clone()))
                .await
                .unwrap_or_else(|| Err("the completer stopped".into()));
            match committed {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(WorkerError::Unsettled(e)),
            }
            if stopping {
                return Err(WorkerError::Unsettled(
                    "the worker is stopping while this attempt's rows are held; its answer is kept on the attempt, or handed on, where it could be, for the reconciler to settle".into(),
                ));
            }
            stopping = self.pause(&mut pause).await.is_err();
        }
    }

    /// Waits `pause` (doubling it, up to [`HELD_PAUSE_MAX`]); `Err` when the
    /// worker is stopping.
    async fn pause(&self, pause: &mut std::time::Duration) -> std::result::Result<(), ()> {
        if self.shutdown.is_triggered() {
            return Err(());
        }
        let wait = *pause;
        *pause = (*pause * 2).min(HELD_PAUSE_MAX);
        tokio::select! {
            () = self.shutdown.wait() => Err(()),
            () = tokio::time::sleep(wait) => Ok(()),
        }
    }

    /// A message whose attempt did not start: a duplicate delivery, an attempt
    /// blocked behind an unknown (published again when the block lifts), or a
    /// message naming no such attempt (dead-lettered here). The delivery is
    /// acked either way.
    async fn not_started(&self, delivery: &Delivery, message: &AttemptMessage) -> Result<()> {
        let state = with_retries(&self.shutdown, "looking up an attempt", || async {
            Ok(self
                .ctx
                .store
                .jobs()
                .attempt_state(message.attempt_id)
                .await?)
        })
        .await?;
        match state {
            Some((job, AttemptStatus::Queued, JobStatus::Unknown)) if job == message.job_id => {
                // Blocked behind an unknown attempt. The attempt stays `queued`,
                // and the settlement that lifts the block publishes its message
                // again, so this delivery can go without costing a delivery count.
                tracing::info!(attempt_id = %message.attempt_id, job_id = %job, "attempt blocked: its job waits for an unknown attempt to be resolved; it is published again when it is");
                Ok(())
            }
            Some((job, _, _)) if job == message.job_id => {
                tracing::debug!(attempt_id = %message.attempt_id, "attempt is not queued any more: duplicate delivery dropped");
                Ok(())
            }
            _ => {
                let reason = format!(
                    "unknown_attempt: no attempt {} of job {} exists",
                    message.attempt_id, message.job_id
                );
                self.dead_letter(delivery, &reason).await
            }
        }
    }

    /// Keeps a message that names no attempt where an operator can see it, with
    /// the reason.
    async fn dead_letter(&self, delivery: &Delivery, reason: &str) -> Result<()> {
        tracing::warn!(%reason, "attempt message dead-lettered");
        with_retries(&self.shutdown, "dead-lettering an attempt message", || {
            self.ctx.publish_dead_letter(&self.queue, delivery, reason)
        })
        .await
    }
}
