//! The evidence pass: one per provider that keeps evidence, none otherwise;
//! an unknown of such a provider is looked up with its own key, and the
//! answer found is kept on its attempt, then settled.

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobStatus};
use onejob::fleet::Role;
use onejob::mock::MockOptions;
use onejob::roles::reconciler::evidence::Evidence;
use onejob::roles::reconciler::kept::Kept;
use onejob::roles::reconciler::pass::Pass;

use super::Bench;
use crate::common::{P, config_for, mock, wait_for, wait_for_status};

/// Providers that keep no evidence (the default) get no pass, so that
/// nothing asks the database for their unknowns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_pass_for_a_provider_without_evidence() {
    let bench = Bench::new("").await;
    assert!(Evidence::passes(&bench.config).is_empty());
}

/// A call that outlived its timeout leaves its attempt unknown while the
/// provider still works on it. With the role stopped, the pass sends the
/// call again with the attempt's key: `409` while the first still runs
/// (looked at again later), then the first call's answer, which is kept and
/// settles the job, and is cleared. The provider ran the work once; the
/// kept-answer pass and a later look find nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unknown_is_settled_from_the_answer_to_its_own_key() {
    let provider = mock(MockOptions {
        replay: true,
        delay: Duration::from_millis(1500),
        ..MockOptions::default()
    })
    .await;
    let options = "timeout = \"500ms\"\nevidence = \"idempotency_key\"\nevidence_delay = \"200ms\"";
    let text = config_for(&[P("primary", &provider.base_url(), options)], "");
    let bench = Bench::with(&text).await;
    let passes = Evidence::passes(&bench.config);
    assert_eq!(passes.len(), 1);
    assert_eq!(passes[0].subject(), Some("primary"));
    let fleet = bench
        .env
        .fleet(bench.config.clone(), vec![Role::Attempts("primary".into())])
        .await;
    let (job_id, publish) = bench.env.admit(&bench.ctx, "acct_e", "e-1", "slow").await;
    bench.ctx.publish_outbox(&[publish]).await.unwrap();
    wait_for_status(&bench.env, job_id, JobStatus::Unknown).await;
    fleet.stop().await;
    let store = &bench.env.store;
    let job = wait_for("the answer found", Duration::from_secs(20), || async {
        bench.run(&passes[0]).await;
        let job = store.jobs().job(job_id).await.unwrap().unwrap();
        (job.status == JobStatus::Succeeded).then_some(job)
    })
    .await;
    assert_eq!(job.attempts.len(), 1, "{job:?}");
    assert_eq!(job.attempts[0].status, AttemptStatus::Succeeded);
    assert_eq!(provider.stats.work(), 1, "the work ran once");
    let attempt = job.attempts[0].id.to_string();
    let keys = provider.stats.idempotency_keys();
    assert!(
        keys.len() >= 2 && keys.iter().all(|k| *k == attempt),
        "{keys:?}"
    );
    let kept = bench
        .count("SELECT count(*) FROM attempts WHERE answer IS NOT NULL")
        .await;
    assert_eq!(kept, 0, "kept, then settled and cleared in the same look");
    assert_eq!(bench.run(&Kept).await, 0);
    assert_eq!(bench.run(&passes[0]).await, 0);
}
