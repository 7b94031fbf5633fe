//! The drain benchmark (`benches/drain`), run small so that it cannot rot: every
//! phase runs against the real services and the debug worker binary, and the
//! report must be whole and consistent. Its speed figures mean nothing here and
//! are not asserted; `scripts/bench-drain` runs the real thing.

use onejob_test_support::drain as run;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_benchmark_runs_and_reports_every_measure() {
    let out = std::env::temp_dir().join(format!("onejob-drain-{}", uuid::Uuid::now_v7()));
    let options = run::Options {
        out: out.clone(),
        ..run::Options::smoke()
    };
    let report = run::drain(&options).await;
    report.write(&out);

    // Every job of the backlog succeeded once, as the database says after the
    // drain: one job per key sent, each with one attempt, one provider call
    // each (the mock's count); intake answered the N/4 re-sends `duplicate`
    // (the worker's own counters), so they cost nothing.
    let n = options.n as i64;
    assert_eq!(report.jobs, n);
    assert_eq!(report.jobs_of_backlog_keys, n, "a job for every key sent");
    assert_eq!(report.jobs_succeeded, n);
    assert_eq!(report.attempt_rows, n);
    assert_eq!(report.provider_calls, options.n as u64);
    assert_eq!(report.intents_created, options.n as u64);
    assert_eq!(report.intents_duplicate, (options.n / 4) as u64);
    // Every figure was measured.
    for (what, v) in [
        ("pgbench", report.pgbench_jobs_per_s),
        ("drain", report.drain_jobs_per_s),
        ("commits per job", report.commits_per_job),
        ("cpu per job", report.worker_cpu_ms_per_job),
        ("peak rss", report.worker_peak_rss_mib),
        ("hop p99", report.hop.p99_ms),
        ("commit p99", report.commit.p99_ms),
        ("call p99", report.call.p99_ms),
        ("latency p99", report.latency.p99_ms),
        ("light latency p99", report.latency_light.p99_ms),
        ("peer drain", report.peer.drain_jobs_per_s),
        ("peer cpu per job", report.peer.cpu_ms_per_job),
        ("peer peak rss", report.peer.peak_rss_mib),
        ("peer commits per job", report.peer.commits_per_job),
        ("peer row writes per job", report.peer.row_writes_per_job),
        ("row writes per job", report.row_writes_per_job),
        ("broker ceiling", report.broker_ceiling_jobs_per_s),
    ] {
        assert!(v.is_finite() && v > 0.0, "{what}: {v}");
    }
    assert!(report.commits > 0);
    every_load_was_measured(&report, &options);
    let md = std::fs::read_to_string(out.join("drain.md")).expect("drain.md");
    for row in [
        "drain / B_pg1",
        "commits per job",
        "p99 at 50% load",
        "peak RSS",
        "duplicates",
        "graphile-worker's drain",
        "the broker's ceiling",
        "at 25% load",
        "row writes",
        "graphile-worker's due → result",
    ] {
        assert!(md.contains(row), "drain.md lacks {row:?}:\n{md}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("drain.json")).expect("drain.json"))
            .expect("drain.json parses");
    // The file carries the measured figures.
    assert_eq!(json["jobs_of_backlog_keys"], report.jobs_of_backlog_keys);
    assert_eq!(json["jobs_succeeded"], report.jobs_succeeded);
    assert_eq!(json["intents_duplicate"], report.intents_duplicate);
    let _ = std::fs::remove_dir_all(&out);
}

/// The latency phase's three loads, the worker's CPU at each, and the peer at
/// the same two loads as onejob's targets, every job of each.
fn every_load_was_measured(report: &run::Report, options: &run::Options) {
    assert_eq!(report.phases.len(), 3);
    for phase in &report.phases {
        assert!(phase.worker_cpu_ms_per_job > 0.0, "{phase:?}");
        assert!(phase.latency.samples > 0, "{phase:?}");
    }
    // The peer was measured at the same two loads, every job of each.
    let loads: Vec<f64> = report.peer.latency.iter().map(|(rate, _)| *rate).collect();
    assert_eq!(loads, [report.light_rate_per_s, report.latency_rate_per_s]);
    assert_eq!(report.peer.add_lag.len(), report.peer.latency.len());
    for (rate, latency) in &report.peer.latency {
        let expected = ((rate * options.latency_seconds as f64) as usize).max(1);
        assert_eq!(latency.samples, expected, "peer latency at {rate}");
        assert!(latency.p99_ms.is_finite() && latency.p99_ms > 0.0);
    }
}
