//! Unserved turns: a turn held for a provider the configuration no longer
//! has fails `provider_not_served` once it has waited `stuck_after`, and its
//! job moves on; a turn held for a provider that is served is left to it.

use onejob::domain::AttemptStatus;
use onejob::edges::store::Admission;
use onejob::roles::reconciler::unserved::Unserved;

use super::Bench;
use crate::common::{P, config_for, new_job};

const OWNERS: &str = "\n[owners]\nmax_in_flight = 1\n";

/// Admits, for owner `acct_u` (who has a `max_in_flight`), a job on
/// `provider`: its turn is held, for the provider's consumers to hand out.
async fn held(bench: &Bench, key: &str, provider: &str) -> onejob::domain::JobId {
    let mut new = new_job("acct_u", key, "held");
    new.provider = provider.into();
    let job_id = new.job_id;
    let admitted = bench.env.store.admission().admit(&[new]).await.unwrap();
    assert!(
        matches!(admitted[0], Admission::Created { publish: None, .. }),
        "held: {admitted:?}"
    );
    job_id
}

/// Configured `primary` and `fallback` only: a turn held for `gone` fails,
/// past `stuck_after`, and its job takes its next attempt on the route; a
/// turn held for `primary` stays held for primary's consumers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_held_for_a_provider_not_configured_fails_and_moves_on() {
    let text = config_for(
        &[
            P("primary", "http://127.0.0.1:9/v1", ""),
            P("fallback", "http://127.0.0.1:9/v1", ""),
        ],
        "",
    )
    .replace("[worker]\n", "[worker]\nstuck_after = \"200ms\"\n")
        + OWNERS;
    let bench = Bench::with(&text).await;
    let gone = held(&bench, "gone", "gone").await;
    let served = held(&bench, "served", "primary").await;
    assert_eq!(
        bench.run_until_done(&Unserved, "stuck_after to pass").await,
        1
    );
    let store = &bench.env.store;
    let job = store.jobs().job(gone).await.unwrap().unwrap();
    assert_eq!(job.attempts[0].status, AttemptStatus::Failed);
    let error = job.attempts[0].error.clone().unwrap_or_default();
    assert!(error.starts_with("provider_not_served:"), "{error}");
    assert_eq!(job.attempts.len(), 2, "the route moves on: {job:?}");
    assert_eq!(bench.run(&Unserved).await, 0);
    let served = store.jobs().job(served).await.unwrap().unwrap();
    assert_eq!(served.attempts[0].status, AttemptStatus::Queued);
    assert_eq!(served.attempts.len(), 1);
}
