//! Pruning jobs: ended jobs past their retention go with their attempts, in
//! batches; a stop ends a run after the batch in hand.

use onejob::edges::shutdown::Shutdown;
use onejob::roles::reconciler::pass::Pass;
use onejob::roles::reconciler::prune_jobs::PruneJobs;

use super::Bench;
use crate::common::{self, config_text};

/// A configuration that keeps succeeded jobs two hours.
async fn bench() -> Bench {
    let text = config_text("http://127.0.0.1:9/v1", None, "")
        + "\n[retention]\nsucceeded = \"2h\"\nfailed = \"2h\"\ncancelled = \"2h\"\n";
    Bench::with(&text).await
}

/// 2,500 jobs ended three hours ago and 20 ended ten minutes ago: a run
/// that is told to stop ends after its first batch of 1,000; the next run
/// takes the other 1,500, and the one after finds nothing. The recent jobs
/// and every attempt of theirs stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_past_their_retention_go_in_batches_until_a_stop() {
    let bench = bench().await;
    let mut db = bench.env.store.pool().acquire().await.unwrap();
    common::fill_jobs(
        &mut db,
        "old",
        2500,
        "succeeded",
        3.0 * 3600.0,
        60.0,
        "summarize",
    )
    .await;
    common::fill_jobs(&mut db, "new", 20, "succeeded", 600.0, 60.0, "summarize").await;
    drop(db);
    let stopping = Shutdown::new();
    stopping.trigger();
    assert_eq!(PruneJobs.once(&bench.ctx, &stopping).await.unwrap(), 1000);
    assert_eq!(bench.run(&PruneJobs).await, 1500);
    assert_eq!(bench.run(&PruneJobs).await, 0);
    assert_eq!(bench.count("SELECT count(*) FROM jobs").await, 20);
    let orphans = bench
        .count("SELECT count(*) FROM attempts a WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = a.job_id)")
        .await;
    assert_eq!(orphans, 0);
    assert_eq!(bench.count("SELECT count(*) FROM attempts").await, 20);
}
