//! Faults found in review (issue 8), each pinned by a test that failed before its
//! fix: providers that send hostile headers or bytes, attempts that time out after
//! their job ended, a start racing a timeout, dead-letter copies the broker would
//! refuse or expire.
//!
//! One binary, its tests by topic: what providers send (`provider_answers`),
//! outcomes that arrive after their job ended (`late_outcomes`), settlements
//! racing each other behind a barrier (`races`), dead letters
//! (`dead_letters`), the broker's faults (`broker_faults`), Postgres
//! outages and stopping workers (`outages`), settlements handed on through
//! the broker when Postgres is away at a stop (`handed_on`), and the reconciler's upkeep
//! (`upkeep`).

use onejob_test_support as common;

mod broker_faults;
mod broker_recovery;
mod dead_letters;
mod handed_on;
mod late_outcomes;
mod lost_claims;
mod moved_past;
mod outages;
mod provider_answers;
mod races;
mod upkeep;

use std::time::Duration;

use common::database::finished;
use common::{P, TestEnv, config, config_for, mock};
use onejob::domain::JobId;
use onejob::edges::store::{Admission, Finished, Started, Store, Verdict};
use onejob::mock::MockOptions;
use onejob_producer::Producer;

/// Admits a job for the primary and starts its first attempt.
async fn started(store: &Store, key: &str) -> (JobId, Started) {
    let new = common::new_job("acct_h", key, key);
    let (job_id, first) = (new.job_id, new.attempt_id);
    let admitted = store.admission().admit(&[new]).await.unwrap();
    assert!(matches!(admitted[0], Admission::Created { .. }));
    let s = store
        .settle()
        .start("primary", &[first], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    (job_id, s)
}

/// Hedges the job on the fallback, and starts the hedge.
async fn started_hedge(store: &Store, job_id: JobId) -> Started {
    let hedge = store
        .sweeps()
        .hedge(job_id, "fallback")
        .await
        .unwrap()
        .unwrap();
    store
        .settle()
        .start("fallback", &[hedge], Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0)
}

fn timed_out(s: &Started) -> Finished {
    finished(
        s,
        Verdict::Unknown {
            error: "outcome_unknown: timed out after the request was sent".into(),
        },
    )
}

/// A fleet with every role behind one mock provider (`provider_extra` adds
/// settings to it), at most `max_attempts` attempts a job, and a producer.
struct Running {
    primary: onejob::mock::MockHandle,
    env: TestEnv,
    fleet: common::Fleet,
    producer: Producer,
    _file: common::tempfile_path::TempConfig,
}

impl Running {
    async fn start(provider_extra: &str, max_attempts: u32) -> Running {
        let primary = mock(MockOptions::default()).await;
        let (config, file) = config(
            &config_for(&[P("primary", &primary.base_url(), provider_extra)], "").replace(
                "max_attempts = 3",
                &format!("max_attempts = {max_attempts}"),
            ),
        );
        let env = TestEnv::new(&config).await;
        let fleet = env.fleet(config.clone(), vec![]).await;
        let producer = Producer::connect(&env.amqp_url).await.unwrap();
        Running {
            primary,
            env,
            fleet,
            producer,
            _file: file,
        }
    }
}
