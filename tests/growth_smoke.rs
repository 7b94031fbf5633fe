//! The growth benchmark (`benches/growth`), run small so that it cannot rot:
//! every phase runs against the real services and the debug worker binary. Its
//! speed figures mean nothing here; what it checks does: the reconciler prunes
//! every ended job past its retention while intake runs, and touches nothing
//! else (jobs kept by their window, `unknown` jobs, jobs whose event is
//! unpublished, the intake's jobs, their attempts), and pruned space is reused.
//! `scripts/bench-growth` runs the real thing.

use onejob_test_support::drain;
use onejob_test_support::growth as run;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_under_intake_removes_exactly_the_expired_jobs_and_reuses_their_space() {
    let _ = drain::BENCH.set("growth");
    let out = std::env::temp_dir().join(format!("onejob-growth-{}", uuid::Uuid::now_v7()));
    let options = run::Options {
        out: out.clone(),
        ..run::Options::smoke()
    };
    let report = run::growth(&options).await;
    report.write(&out);

    assert_eq!(report.fill_left, 0, "rows of the fills were left");
    assert!(report.kept_unchanged, "a kept row or an intake job changed");
    assert_eq!(report.intake_found, report.intake_published as i64);
    assert!(report.intake_published > 0);
    // A fill, read back from the tables: N jobs and, per twenty jobs, 16
    // succeeded and 1 cancelled with one attempt, 3 failed with three.
    assert_eq!(report.jobs_per_fill, options.n as i64);
    assert_eq!(report.attempts_per_fill, options.n as i64 * 26 / 20);
    // The pruning worker's own count: every fill's jobs and attempts, and
    // nothing else.
    let fills = report.fills as u64;
    assert_eq!(report.fills, options.refills + 1);
    assert_eq!(report.pruned_jobs, fills * report.jobs_per_fill as u64);
    assert_eq!(
        report.pruned_attempts,
        fills * report.attempts_per_fill as u64
    );
    // Once pruning has run a while, a fill goes into the space the one
    // before it left.
    assert!(
        report.steady_growth() <= 0.10,
        "the last refill grew the tables by {:.3} of what the first fill did",
        report.steady_growth()
    );
    // Compacted, with only the floor's rows left, the tables are the floor.
    assert!(
        report.back_to_floor() <= 1.10,
        "compacted tables at {:.3} of the floor",
        report.back_to_floor()
    );
    for (what, p) in [("baseline", &report.baseline), ("pruning", &report.pruning)] {
        assert!(p.samples > 0 && p.p99_ms.is_finite(), "{what}: {p:?}");
    }
}
