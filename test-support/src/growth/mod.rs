//! One run of the growth benchmark, shared by `cargo bench --bench growth` and
//! the smoke test that keeps it from rotting (`tests/growth_smoke.rs`).
//!
//! In one run, on this machine's PostgreSQL and RabbitMQ, with one
//! `onejob-worker` process (every role) and the instant mock provider:
//!
//! 1. **Floor**: a little intake, and the rows that must outlive every prune:
//!    succeeded jobs just inside their 7-day window, failed ones inside their
//!    30 days, `unknown` jobs 90 days old, and old succeeded jobs whose event is
//!    still unpublished. The tables' sizes now are the floor.
//! 2. **Fill**: N ended jobs (80% succeeded, 15% failed, 5% cancelled; a failed
//!    one has three attempts) that ended 31 to 61 days ago, in one statement.
//! 3. **Baseline**: while a worker with a ten-year retention runs (it prunes
//!    nothing), intents arrive on a fixed schedule (open loop) and each job's
//!    latency runs from its intent's due time to its `job.succeeded` event.
//! 4. **Pruning**: a worker with the default retention (`[retention]` unset)
//!    takes over and prunes the N jobs while the same intake runs, in windows of
//!    a few seconds, until its `onejob_pruned_total` says all N are gone. Then
//!    the run waits until no table is left with more dead rows than
//!    autovacuum's threshold (the server's autovacuum, or, where it is off, the
//!    pruner's own vacuum).
//! 5. **Refills**: N more, pruned the same way, without intake, twice (by
//!    default): the space the N before left must be reused, not added to. The
//!    first refill grows the indexes by the pages the last vacuum emptied but
//!    could not yet hand out (a B-tree page is reusable only once no
//!    transaction can still see it: at the next vacuum); from the second on,
//!    a fill fits in what the one before it left.
//! 6. **VACUUM FULL**, with the worker stopped: what returning the space to the
//!    operating system costs. Then the intake's own jobs (those that arrived
//!    after the floor) are deleted and the tables are compacted again: they
//!    must be back to their floor.
//!
//! Then it checks that every row of step 1, the intake's jobs and their attempts
//! are exactly as they were, and that nothing of the N is left.
//!
//! The phases live beside this file (`phases`), with the queries on the
//! run's tables (`tables`) and the report (`report`).

mod phases;
mod report;
mod tables;

use std::path::PathBuf;

use onejob::mock::MockOptions;

use crate::drain::{Worker, free_port, machine, say};
use crate::{TestEnv, config, mock};
use phases::{Run, worker_counts};
use tables::kept_rows;

pub use report::Report;

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Ended jobs in each fill.
    pub n: usize,
    /// Intents per second during the baseline and the pruning.
    pub rate: f64,
    /// Length of the baseline.
    pub baseline_seconds: u64,
    /// Length of each window of the pruning phase's intake.
    pub window_seconds: u64,
    /// Fills after the first, each pruned before the next.
    pub refills: usize,
    /// Where the report goes.
    pub out: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            n: 1_000_000,
            rate: 200.0,
            baseline_seconds: 60,
            window_seconds: 10,
            refills: 2,
            out: PathBuf::from("target/bench"),
        }
    }
}

impl Options {
    /// A run of a minute or so: everything measured, nothing worth quoting.
    pub fn smoke() -> Self {
        Self {
            n: 3000,
            rate: 20.0,
            baseline_seconds: 2,
            window_seconds: 2,
            ..Self::default()
        }
    }
}

/// Runs the whole benchmark.
pub async fn growth(options: &Options) -> Report {
    let provider = mock(MockOptions::default()).await;
    let base = onejob::settings::config::EMBEDDED_DEFAULT
        .replace("http://127.0.0.1:8081/v1", &provider.base_url());
    // The baseline's worker keeps everything; the pruning one has the defaults.
    let keep_all = format!(
        "{base}\n[retention]\nsucceeded = \"3650d\"\nfailed = \"3650d\"\ncancelled = \"3650d\"\n"
    );
    let (config_keep, file_keep) = config(&keep_all);
    let (_, file_prune) = config(&base);
    let env = TestEnv::new(&config_keep).await;
    std::fs::create_dir_all(&options.out).expect("create the report folder");
    let machine = machine(&env).await;
    say(&format!("on {machine}"));
    let (mut run, autovacuum) = Run::open(&env, &config_keep, options).await;
    let mut worker = Worker::start(
        &env,
        &file_keep.path,
        &options.out.join("worker-keep.log"),
        Some(free_port()),
    );
    worker.wait_ready().await;

    let (kept, floor_at) = run.floor().await;
    let fill = run.fill().await;
    let baseline = run.baseline().await;
    worker.stop().await;
    let before = kept_rows(&mut run.db).await;

    say("pruning: the default retention, intake running");
    let mut worker = Worker::start(
        &env,
        &file_prune.path,
        &options.out.join("worker-prune.log"),
        Some(free_port()),
    );
    worker.wait_ready().await;
    let pruning = run.prune(&mut worker, fill.attempts).await;
    let refills = run.refills(&mut worker, fill.attempts).await;
    let (pruned_jobs, pruned_attempts, worker_vacuums) = worker_counts(&worker).await;
    worker.stop().await;

    let after = kept_rows(&mut run.db).await;
    let (fill_left, intake_found) = run.leftovers().await;
    let vacuum_full_seconds = run.compact(&floor_at).await;
    let sizes = run.close().await;

    Report {
        machine,
        autovacuum,
        n: options.n,
        jobs_per_fill: fill.jobs,
        attempts_per_fill: fill.attempts,
        fills: options.refills + 1,
        pruned_jobs,
        pruned_attempts,
        kept,
        rate: options.rate,
        fill_seconds: fill.seconds,
        refill_seconds: refills.seconds,
        baseline,
        pruning: pruning.latency,
        windows: pruning.windows,
        prune_seconds: pruning.prune_seconds,
        refill_prune_seconds: refills.prune_seconds,
        vacuum_wait_seconds: pruning.vacuum_wait_seconds,
        worker_vacuums,
        vacuum_full_seconds,
        sizes,
        fill_left,
        kept_unchanged: before == after && before.0 > 0,
        intake_published: pruning.intake_published,
        intake_found,
    }
}
