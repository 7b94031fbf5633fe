//! Hedging: a job whose attempt has been silent for its operation's
//! `hedge_after` gets one parallel attempt on the next qualified provider;
//! none when no other provider is qualified.

use std::time::Duration;

use onejob::domain::AttemptStatus;
use onejob::mock::MockOptions;
use onejob::roles::reconciler::hedge::Hedge;

use super::Bench;
use crate::common::database::started;
use crate::common::{hedged_config, mock, wait_for};

/// Waits until every started attempt has been silent past `hedge_after`
/// (300 ms), as the database's clock says.
async fn silent_past_hedge_after(bench: &Bench) {
    wait_for("hedge_after to pass", Duration::from_secs(10), || async {
        let young = bench
            .count("SELECT count(*) FROM attempts WHERE status = 'started' AND started_at > now() - interval '400 ms'")
            .await;
        (young == 0).then_some(())
    })
    .await;
}

/// With the fallback qualified, one run starts one hedge on it, queued
/// beside the silent primary; the next run starts no second.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_attempt_is_hedged_once_on_the_next_qualified_provider() {
    let fallback = mock(MockOptions::default()).await;
    let bench = Bench::with(&hedged_config(
        "http://127.0.0.1:9/v1",
        &fallback.base_url(),
    ))
    .await;
    bench
        .env
        .cli_ok(&bench.file.path, &["providers", "qualify", "fallback"]);
    let s = started(&bench.env.store, "hedge", 1).await.remove(0);
    silent_past_hedge_after(&bench).await;
    assert_eq!(bench.run(&Hedge).await, 1);
    let job = bench.env.store.jobs().job(s.job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts.len(), 2, "{job:?}");
    assert_eq!(job.attempts[0].status, AttemptStatus::Started);
    assert_eq!(job.attempts[1].provider, "fallback");
    assert_eq!(bench.run(&Hedge).await, 0, "one hedge per job");
}

/// With no other qualified provider, a silent attempt gets no hedge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_hedge_without_another_qualified_provider() {
    let bench = Bench::with(&hedged_config(
        "http://127.0.0.1:9/v1",
        "http://127.0.0.1:9/v1",
    ))
    .await;
    let s = started(&bench.env.store, "unhedged", 1).await.remove(0);
    silent_past_hedge_after(&bench).await;
    assert_eq!(bench.run(&Hedge).await, 0);
    let job = bench.env.store.jobs().job(s.job_id).await.unwrap().unwrap();
    assert_eq!(job.attempts.len(), 1, "{job:?}");
}
