//! A held turn with no way out: only a consumer of a turn's provider hands it
//! out, so a turn held for a provider that was removed from the
//! configuration would wait for ever. Once it has waited `stuck_after`, it
//! fails `provider_not_served` and its job moves on along its route; the
//! gauges and the console show held turns by provider meanwhile.

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::edges::store::Admission;
use onejob::mock::MockOptions;

use crate::common::{self, P, TestEnv, config, config_for, mock, wait_for_status};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_held_for_a_provider_no_longer_configured_moves_on() {
    let primary = mock(MockOptions::default()).await;
    let owners = "\n[owners]\nmax_in_flight = 1\n";
    // Before: the route's first provider is `gone`, and the owner has
    // `max_in_flight`, so its first attempt's turn is held.
    let before = config_for(
        &[
            P("gone", "http://127.0.0.1:9/v1", ""),
            P("primary", &primary.base_url(), ""),
        ],
        "",
    ) + owners;
    let (old, _old_file) = config(&before);
    let env = TestEnv::new(&old).await;
    let mut new = common::new_job("acct_gone", "g-1", "moved on");
    new.provider = "gone".into();
    let job_id = new.job_id;
    let admitted = env.store.admission().admit(&[new]).await.unwrap();
    assert!(
        matches!(admitted[0], Admission::Created { publish: None, .. }),
        "{admitted:?}"
    );
    let gauges = env.store.jobs().gauges().await.unwrap();
    assert!(
        gauges.contains("onejob_turns_held{provider=\"gone\"} 1\n"),
        "{gauges}"
    );
    let held = env.store.turns().held_turns().await.unwrap();
    assert_eq!((held[0].provider.as_str(), held[0].held), ("gone", 1));

    // After: `gone` is removed. Its turn is handed out by no one; past
    // stuck_after it fails, and the job runs on the route's provider.
    let after = config_for(&[P("primary", &primary.base_url(), "")], "")
        .replace("[worker]\n", "[worker]\nstuck_after = \"1s\"\n")
        + owners;
    let (new_config, _new_file) = config(&after);
    let fleet = env.fleet(new_config, vec![]).await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    fleet.stop().await;
    let first = &job.attempts[0];
    assert_eq!(
        (first.provider.as_str(), first.status),
        ("gone", AttemptStatus::Failed)
    );
    let error = first.error.clone().unwrap_or_default();
    assert!(error.starts_with("provider_not_served:"), "{error}");
    assert_eq!(job.attempts[1].provider, "primary");
    assert!(env.store.turns().held_turns().await.unwrap().is_empty());
}
