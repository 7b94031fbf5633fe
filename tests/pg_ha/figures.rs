//! The failover benchmark (`benches/failover`), run small so that it cannot
//! rot: every phase runs on real clusters of `scripts/pg-ha` and the debug
//! worker binary, and the report must be whole and consistent. Its figures
//! mean nothing here and are not asserted; `scripts/bench-failover` runs the
//! real thing.

use onejob_test_support::failover as run;
use onejob_test_support::pg_ha::installed;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failover_benchmark_runs_and_reports_every_measure() {
    if !installed("the_failover_benchmark_runs_and_reports_every_measure") {
        return;
    }
    let out = std::env::temp_dir().join(format!("onejob-failover-{}", uuid::Uuid::now_v7()));
    let options = run::Options {
        out: out.clone(),
        ..run::Options::smoke()
    };
    let report = run::run(&options).await;
    report.write(&out);

    // One server, then the synchronous and the asynchronous cluster, each
    // drained and timed.
    assert_eq!(report.sites.len(), 3);
    for site in &report.sites {
        assert!(site.drain_jobs_per_s > 0.0, "{site:?}");
        assert_eq!(site.latency.samples, 100 * options.latency_seconds as usize);
        assert!(site.latency.p99_ms.is_finite(), "{site:?}");
    }
    // The failover: every intent of the open loop came through, some of them
    // due while no primary took writes; the first write and the first
    // admission came after the crash.
    let f = report.failover.as_ref().expect("the failover phase ran");
    assert_eq!(f.intents, 100 * options.failover_seconds as usize);
    assert_eq!(
        f.before.samples + f.during.samples + f.after.samples,
        f.intents
    );
    assert!(f.during.samples > 0, "{f:?}");
    assert!(f.crash_to_first_write_s > 0.0, "{f:?}");
    assert!(f.crash_to_first_admission_s > 0.0, "{f:?}");
    // The loss phase counted every intent it streamed; at least every job it
    // has was called.
    let l = report.loss.as_ref().expect("the loss phase ran");
    assert_eq!(l.intents, options.loss_n);
    assert!(l.succeeded_before_crash >= options.loss_n / 3, "{l:?}");
    assert!(l.calls >= l.intents - l.intents_without_job, "{l:?}");
    let md = std::fs::read_to_string(out.join("failover.md")).expect("failover.md written");
    for section in [
        "What replication costs",
        "A failover, synchronous replication",
        "What asynchronous replication lost",
    ] {
        assert!(md.contains(section), "{section} in\n{md}");
    }
    assert!(out.join("failover.json").exists());
    let _ = std::fs::remove_dir_all(&out);
}
