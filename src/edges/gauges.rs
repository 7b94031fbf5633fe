//! The gauges `/metrics` serves (jobs and attempts by status, the oldest
//! unknown, the outbox backlog), read from the tables by a timer and kept: a
//! scrape, however frequent, costs the database nothing and never waits on it.
//! `onejob_gauges_age_seconds` says how old the figures are; it grows while
//! the database cannot be read.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::edges::store::Store;

/// How often the gauges are read from the tables.
pub(crate) const REFRESH: Duration = Duration::from_secs(10);

/// The latest gauges read, and when.
#[derive(Default)]
pub(crate) struct Gauges {
    latest: Mutex<Option<(Instant, String)>>,
}

impl Gauges {
    /// Gauges read from `store` now and then every [`REFRESH`], for as long
    /// as the returned handle (or a clone) is kept.
    pub(crate) fn refreshed(store: Store) -> Arc<Gauges> {
        let gauges = Arc::new(Gauges::default());
        let kept = Arc::downgrade(&gauges);
        tokio::spawn(refresh(store, kept));
        gauges
    }

    /// The gauges as Prometheus text, with their age; `None` before they were
    /// first read.
    pub(crate) fn text(&self) -> Option<String> {
        let latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
        let (at, text) = latest.as_ref()?;
        Some(format!(
            "{text}# TYPE onejob_gauges_age_seconds gauge\nonejob_gauges_age_seconds {:.3}\n",
            at.elapsed().as_secs_f64()
        ))
    }
}

async fn refresh(store: Store, kept: Weak<Gauges>) {
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let read = store.jobs().gauges().await;
        let Some(gauges) = kept.upgrade() else {
            return;
        };
        match read {
            Ok(text) => {
                *gauges.latest.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((Instant::now(), text));
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the gauges; /metrics serves the last ones read")
            }
        }
    }
}
