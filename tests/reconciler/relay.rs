//! The relay: an outbox row whose publisher did not mark it is published once
//! its lease runs out, and never while the lease holds.

use std::time::Duration;

use onejob::roles::reconciler::relay::Relay;

use super::Bench;
use crate::common::{self, wait_for};

/// An admitted attempt whose message its intake never published (the worker
/// died after the commit): within the lease the relay leaves it to its
/// publisher; after, one run publishes it and marks it, and the next finds
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_its_publisher_left_is_published_once_its_lease_runs_out() {
    let bench = Bench::new("outbox_lease = \"1s\"").await;
    let (job_id, _never_published) = bench.env.admit(&bench.ctx, "acct_r", "r-1", "relay").await;
    assert_eq!(bench.run(&Relay).await, 0, "the publisher's lease holds");
    assert_eq!(
        bench.run_until_done(&Relay, "the lease to run out").await,
        1
    );
    let ch = bench.ctx.connection.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    let got = common::wait_for_messages(&bench.env, &ch, &queue).await;
    assert_eq!(got.len(), 1);
    let body: serde_json::Value = serde_json::from_slice(&got[0].data).unwrap();
    assert_eq!(body["job_id"], job_id.to_string());
    common::all_published(&bench.env.store).await;
    assert_eq!(bench.run(&Relay).await, 0, "published once");
}

/// A row its publisher published and marked is never relayed, lease or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_its_publisher_published_is_left_alone() {
    let bench = Bench::new("outbox_lease = \"200ms\"").await;
    let (_, publish) = bench.env.admit(&bench.ctx, "acct_r", "r-2", "relay").await;
    bench.ctx.publish_outbox(&[publish]).await.unwrap();
    common::all_published(&bench.env.store).await;
    wait_for("the lease to run out", Duration::from_secs(10), || async {
        let leased = bench
            .count("SELECT count(*) FROM outbox WHERE lease_until >= now()")
            .await;
        (leased == 0).then_some(())
    })
    .await;
    assert_eq!(bench.run(&Relay).await, 0);
    let ch = bench.ctx.connection.create_channel().await.unwrap();
    let queue = onejob::broker::attempts_queue("primary");
    assert_eq!(bench.env.drain(&ch, &queue).await.len(), 1, "one copy");
}
