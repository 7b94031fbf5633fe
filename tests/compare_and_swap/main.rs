//! When attempts race, the compare-and-swap on the job row lets exactly one win; a
//! late arrival is discarded whole, never merged. These tests drive the store
//! directly, on the real Postgres, with concurrent connections.
//!
//! One binary, its tests by topic: races of known shape, in order, at once and
//! in flushes (`winners`), thousands of random interleavings (`interleavings`),
//! a worker that vanished (`vanished`), and a claim the database lost
//! (`lost_claims`).

use onejob_test_support as common;

mod interleavings;
mod lost_claims;
mod vanished;
mod winners;

use std::time::Duration;

use common::database::success;
use onejob::domain::JobId;
use onejob::edges::store::{Admission, Finished, NewJob, Settled, Started, Store, Verdict};
use serde_json::json;

/// A validated intent for the primary provider, ready to admit.
fn new_job(key: &str) -> NewJob {
    common::new_job("acct_cas", key, key)
}

/// A job whose main attempt started first and whose hedge started second.
async fn two_started_attempts(store: &Store, key: &str) -> (JobId, Started, Started) {
    let new = new_job(key);
    let (job_id, first) = (new.job_id, new.attempt_id);
    let admitted = store.admission().admit(&[new]).await.unwrap();
    assert!(matches!(admitted[0], Admission::Created { .. }));
    let a = store
        .settle()
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    let hedge = store
        .sweeps()
        .hedge(job_id, "fallback")
        .await
        .unwrap()
        .expect("hedge allowed");
    let b = store
        .settle()
        .start("fallback", &[hedge], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    assert_eq!((a.version, b.version), (0, 0));
    (job_id, a, b)
}

fn finished(s: &Started, verdict: Verdict) -> Finished {
    Finished {
        attempt_id: s.attempt_id,
        job_id: s.job_id,
        version: s.version,
        provider_request_id: Some(format!("req-{}", s.attempt_id)),
        usage: Some(json!({"total_tokens": 10})),
        verdict,
        asked: None,
    }
}

/// Settles `batch` as the attempt path does (see [`common::settle_with`]).
async fn settle(store: &Store, batch: &[Finished]) -> Vec<Settled> {
    common::settle_with(store, batch, &common::give_up).await
}
