//! The attempts this worker took on admission ([`super::admitted`]) whose
//! deliveries have not come yet, each with its claim's outcome: a delivery
//! of one started here is dropped, and one that comes while the claim runs
//! waits for its outcome rather than claim beside it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::domain::AttemptId;

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
    pub(super) fn claiming(&self, attempt: AttemptId) {
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
    pub(super) fn claimed(&self, attempt: AttemptId, started: bool) {
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
