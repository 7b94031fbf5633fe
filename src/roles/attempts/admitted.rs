//! Attempts this worker's own intake has just admitted
//! ([`crate::shared::runtime::own_consumers`]): taken while a call slot is free,
//! claimed through the same claim group commit as a delivery, called and
//! settled. An attempt that does not start here (its job row held, blocked,
//! taken by a delivery first, a claim that failed) is left to its message.
//! The delivery of an attempt started here is acked at once, with neither a
//! claim nor a look-up: the attempt is this worker's call. One that comes
//! while the claim here runs waits for its outcome rather than claim beside
//! it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::claim::ClaimAnswer;
use super::consumer::Consumer;
use crate::domain::AttemptId;
use crate::trace::TraceContext;

/// How long an attempt taken here is remembered for its delivery: a
/// delivery that comes later (it went to another worker, or this one was
/// slow) is claimed as any delivery, and finds the attempt taken.
const REMEMBERED_FOR: Duration = Duration::from_secs(60);
/// The most attempts remembered at once.
const REMEMBERED_MOST: usize = 65_536;

/// The attempts taken here whose deliveries have not come yet, each with its
/// claim's outcome: `None` while the claim runs, then whether it started.
#[derive(Default)]
pub(super) struct Taken {
    inner: Mutex<Remembered>,
}

/// The attempts, and when each was taken, oldest first.
#[derive(Default)]
struct Remembered {
    by_attempt: HashMap<AttemptId, Arc<watch::Sender<Option<bool>>>>,
    order: VecDeque<(Instant, AttemptId)>,
}

impl Taken {
    /// Remembers `attempt` as being claimed here.
    fn claiming(&self, attempt: AttemptId) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let Remembered { by_attempt, order } = &mut *inner;
        while let Some((at, old)) = order.front()
            && (at.elapsed() > REMEMBERED_FOR || order.len() >= REMEMBERED_MOST)
        {
            by_attempt.remove(old);
            order.pop_front();
        }
        let (outcome, _) = watch::channel(None);
        if by_attempt.insert(attempt, Arc::new(outcome)).is_none() {
            order.push_back((Instant::now(), attempt));
        }
    }

    /// Tells whether the claim here started `attempt`; one that did not is
    /// forgotten, its delivery claimed as any.
    fn claimed(&self, attempt: AttemptId, started: bool) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let outcome = if started {
            inner.by_attempt.get(&attempt).cloned()
        } else {
            inner.by_attempt.remove(&attempt)
        };
        if let Some(outcome) = outcome {
            outcome.send_replace(Some(started));
        }
    }

    /// Whether a delivery of `attempt` finds it started here (the delivery
    /// is then dropped: the call is this worker's). While the claim here
    /// runs, the delivery waits for its outcome rather than claim beside it.
    /// Forgotten once answered yes: one delivery is expected.
    pub(super) async fn started_here(&self, attempt: AttemptId) -> bool {
        let outcome = {
            let Ok(inner) = self.inner.lock() else {
                return false;
            };
            match inner.by_attempt.get(&attempt) {
                Some(outcome) => outcome.subscribe(),
                None => return false,
            }
        };
        let mut outcome = outcome;
        let started = outcome
            .wait_for(Option::is_some)
            .await
            .is_ok_and(|v| *v == Some(true));
        if started && let Ok(mut inner) = self.inner.lock() {
            inner.by_attempt.remove(&attempt);
        }
        started
    }
}

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
            crate::shared::metrics::attempt_claimed_on_admission(&consumer.client.provider().name);
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
