//! Attempts this worker's own intake has just admitted
//! ([`crate::runtime::own_consumers`]): taken while a call slot is free,
//! claimed through the same claim group commit as a delivery, called and
//! settled. An attempt that does not start here (its job row held, blocked,
//! taken by a delivery first, a claim that failed) is left to its message.
//! The delivery of an attempt started here is acked at once, with neither a
//! claim nor a look-up: the attempt is this worker's call.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::claim::ClaimAnswer;
use super::consumer::Consumer;
use crate::domain::AttemptId;
use crate::trace::TraceContext;

/// How long an attempt started here is remembered for its delivery: a
/// delivery that comes later (it went to another worker, or this one was
/// slow) is claimed as any delivery, and finds the attempt taken.
const REMEMBERED_FOR: Duration = Duration::from_secs(60);
/// The most attempts remembered at once.
const REMEMBERED_MOST: usize = 65_536;

/// The attempts started here whose deliveries have not come yet.
#[derive(Default)]
pub(super) struct Taken {
    inner: Mutex<Remembered>,
}

/// The attempts, and when each was remembered, oldest first.
#[derive(Default)]
struct Remembered {
    set: HashSet<AttemptId>,
    order: VecDeque<(Instant, AttemptId)>,
}

impl Taken {
    fn insert(&self, attempt: AttemptId) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let Remembered { set, order } = &mut *inner;
        while let Some((at, old)) = order.front()
            && (at.elapsed() > REMEMBERED_FOR || order.len() >= REMEMBERED_MOST)
        {
            set.remove(old);
            order.pop_front();
        }
        if set.insert(attempt) {
            order.push_back((Instant::now(), attempt));
        }
    }

    /// Whether `attempt` was started here (forgotten once asked: one
    /// delivery is expected).
    pub(super) fn take(&self, attempt: AttemptId) -> bool {
        self.inner
            .lock()
            .is_ok_and(|mut inner| inner.set.remove(&attempt))
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
        let consumer = self.clone();
        let Ok(mut local) = self.local.lock() else {
            return false;
        };
        while local.try_join_next().is_some() {}
        local.spawn(async move {
            let claimed = consumer.claims.submit(attempt).await;
            let Some(Ok(ClaimAnswer::Started(started, _))) = claimed else {
                return;
            };
            consumer.taken.insert(attempt);
            tracing::debug!(attempt_id = %attempt, "attempt started on admission");
            crate::metrics::attempt_claimed_on_admission(&consumer.client.provider().name);
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
