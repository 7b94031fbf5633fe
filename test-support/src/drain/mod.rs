//! One run of the drain benchmark, shared by `cargo bench --bench drain` and the
//! smoke test that keeps it from rotting (`tests/drain_smoke.rs`).
//!
//! In one run, on this machine's PostgreSQL and RabbitMQ:
//!
//! 1. **Parts**: the p99 of one broker hop (a persistent publish to a quorum
//!    queue, confirmed and delivered), one commit (a one-row autocommitted
//!    INSERT) and one call to the instant mock provider, each measured alone.
//! 2. **B_pg1**: pgbench running onejob's own per-job SQL on onejob's tables in a
//!    scratch database: the admission insert (job and attempt), `queued →
//!    started`, and the compare-and-swap finalize, each statement its own
//!    transaction, 4 clients, prepared statements.
//! 3. **Drain**: N distinct intents plus N/4 duplicates are published while no
//!    worker runs; then one `onejob-worker` process with every role starts, and
//!    the clock runs from its start until every job's `job.succeeded` event has
//!    arrived. Commits come from `pg_stat_database` (every transaction of the
//!    run's database, the worker's reads included), CPU and peak RSS from the
//!    worker's `/proc` entry, provider calls from the mock.
//! 4. **Latency**: a fresh worker; an open-loop generator publishes at 100
//!    intents/s, then at half the drain rate, on a fixed schedule, and each
//!    job's latency runs from the time its intent was *due* to be published to
//!    the arrival of its event, so that a generator held up by a stall still
//!    counts the wait (no coordinated omission).
//! 5. **The peer**: graphile-worker, tuned as its authors advise, drains the
//!    same number of jobs making the same instant call, then takes the same two
//!    open-loop loads; its latency runs from due time to its result's commit.
//!
//! The steps live beside this file: `parts`, `pgbench`, `load` (the backlog,
//! the generator and the events), `worker` (the process and its metrics),
//! `database` (what the run's database counted), `cores` (the machine's CPU
//! by program), `peer` (graphile-worker, with
//! its script in `benches/drain/peer/`) and `report`.

mod cores;
mod database;
mod load;
mod parts;
mod peer;
mod pgbench;
mod progress;
mod report;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use onejob::mock::{MockHandle, MockOptions};
use onejob_producer::Producer;

use crate::{TestEnv, config, mock};
pub use cores::{CpuClock, CpuPerJob};
use database::{backlog_jobs, counts, settle_after_the_drain, settled_counts};
use load::stages;
use parts::{broker_ceiling, call_latency, commit_latency, hop_latency};
use pgbench::pgbench;
use worker::Usage;

pub use load::{Events, Timing, open_loop, preload};
pub use progress::{bar, say};
pub use report::{Percentiles, Report, machine};
pub use worker::{Worker, WorkerStage, free_port};
// Not every program that includes this file uses these two: the growth
// benchmark and its smoke test name themselves with BENCH, and the smoke tests
// print no report.
#[allow(unused_imports)]
pub use progress::{BENCH, run_and_report};

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Distinct intents in the backlog; a quarter as many duplicates come with them.
    pub n: usize,
    /// The open-loop latency phase.
    pub latency_seconds: u64,
    /// Its load, as a share of the drain rate (the target is set at 0.5).
    pub latency_load: f64,
    /// The pgbench baseline.
    pub pgbench_seconds: u64,
    /// Samples of each part.
    pub part_samples: usize,
    /// Where the report goes.
    pub out: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            n: 20_000,
            latency_seconds: 20,
            latency_load: 0.5,
            pgbench_seconds: 15,
            part_samples: 500,
            out: PathBuf::from("target/bench"),
        }
    }
}

impl Options {
    /// A run of a few seconds: everything measured, nothing worth quoting.
    pub fn smoke() -> Self {
        Self {
            n: 300,
            latency_seconds: 2,
            pgbench_seconds: 2,
            part_samples: 50,
            ..Self::default()
        }
    }
}

/// Runs the whole benchmark.
pub async fn drain(options: &Options) -> Report {
    let provider = mock(MockOptions::default()).await;
    // The embedded defaults, pointed at this run's mock: what a new user runs.
    let text = onejob::settings::config::EMBEDDED_DEFAULT
        .replace("http://127.0.0.1:8081/v1", &provider.base_url());
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let machine = announce(&env, options).await;

    let (hop, commit, call) = parts(&env, &provider, options).await;
    let pgbench_jobs_per_s = pgbench(&env, &config, options).await;

    let duplicates = options.n / 4;
    let producer = Arc::new(
        Producer::connect(&env.amqp_url)
            .await
            .expect("producer connects"),
    );
    let mut events = Events::watch(&env).await;
    preload(&producer, options.n, duplicates).await;
    let drained = drain_backlog(&env, &file.path, &provider, &events, options).await;
    let drain_jobs_per_s = options.n as f64 / drained.seconds;

    let loads = loads(drain_jobs_per_s, options);
    let rate = loads[2].0;
    let (phases, worker_stages, stages) =
        latency_phase(&env, &file.path, &producer, &mut events, &loads, options).await;
    if let Ok(producer) = Arc::try_unwrap(producer) {
        producer.close().await;
    }
    say("the peer: graphile-worker, the same calls, in this run");
    let peer = peer::graphile(&env, &provider.base_url(), options, &[loads[0].0, rate]).await;
    let (light, latency) = (phases[0].latency.clone(), phases[2].latency.clone());
    let ceiling = broker_ceiling(&env, options.n.min(10_000) * MESSAGES_PER_JOB).await;

    let parts_p99_sum_ms = 2.0 * hop.p99_ms + 2.0 * commit.p99_ms + call.p99_ms;
    Report {
        machine,
        n: options.n,
        duplicates,
        pgbench_jobs_per_s,
        drain_seconds: drained.seconds,
        drain_jobs_per_s,
        drain_over_pgbench: drain_jobs_per_s / pgbench_jobs_per_s,
        commits: drained.commits,
        commits_per_job: drained.commits as f64 / options.n as f64,
        row_writes_per_job: drained.row_writes as f64 / options.n as f64,
        broker_ceiling_jobs_per_s: ceiling / MESSAGES_PER_JOB as f64,
        messages_per_job: MESSAGES_PER_JOB,
        drain_over_broker: drain_jobs_per_s * MESSAGES_PER_JOB as f64 / ceiling,
        worker_cpu_ms_per_job: drained.usage.cpu_seconds * 1000.0 / options.n as f64,
        drain_cpu: drained.cpu,
        worker_peak_rss_mib: drained.usage.peak_rss_kib as f64 / 1024.0,
        intake_batch_mean: drained.batches[0],
        claim_batch_mean: drained.batches[1],
        settle_batch_mean: drained.batches[2],
        jobs: drained.jobs,
        jobs_succeeded: drained.jobs_succeeded,
        jobs_of_backlog_keys: drained.jobs_of_backlog_keys,
        attempt_rows: drained.attempt_rows,
        provider_calls: drained.provider_calls,
        intents_created: drained.intents_created,
        intents_duplicate: drained.intents_duplicate,
        p99_over_parts: latency.p99_ms / parts_p99_sum_ms,
        hop,
        commit,
        call,
        parts_p99_sum_ms,
        latency_load: options.latency_load,
        latency_rate_per_s: rate,
        latency,
        light_rate_per_s: loads[0].0,
        latency_light: light,
        phases,
        stages,
        worker_stages,
        peer,
    }
}

/// Makes the report's folder, and says what machine this runs on.
async fn announce(env: &TestEnv, options: &Options) -> String {
    std::fs::create_dir_all(&options.out).expect("create the report folder");
    let machine = machine(env).await;
    say(&format!("on {machine}"));
    machine
}

/// The light load both latencies are measured at besides half the drain
/// rate, in jobs per second.
const LIGHT_LOAD: f64 = 100.0;

/// The latency phase's loads, with their keys' prefixes: the light load, a
/// quarter of the drain rate, and `latency_load` of it (half, the target's).
fn loads(drain_jobs_per_s: f64, options: &Options) -> [(f64, &'static str); 3] {
    let rate = (drain_jobs_per_s * options.latency_load).max(1.0);
    [
        (LIGHT_LOAD.min(rate), "c-"),
        ((drain_jobs_per_s / 4.0).max(1.0), "q-"),
        (rate, "l-"),
    ]
}

/// The broker messages a job of the drain costs: its intent, its attempt
/// message and its event (the drain publishes without receipts).
const MESSAGES_PER_JOB: usize = 3;

/// The parts' latencies, each alone: a broker hop, a commit, a provider call.
async fn parts(
    env: &TestEnv,
    provider: &MockHandle,
    options: &Options,
) -> (Percentiles, Percentiles, Percentiles) {
    say("measuring the parts: broker hop, commit, provider call");
    let hop = hop_latency(env, options.part_samples).await;
    let commit = commit_latency(env, options.part_samples).await;
    let call = call_latency(&provider.base_url(), options.part_samples).await;
    (hop, commit, call)
}

/// What the drain measured.
struct Drained {
    seconds: f64,
    usage: Usage,
    /// The machine's CPU per job, by program.
    cpu: CpuPerJob,
    /// Mean intake, claim and settle batch sizes.
    batches: [f64; 3],
    intents_created: u64,
    intents_duplicate: u64,
    provider_calls: u64,
    commits: i64,
    row_writes: i64,
    jobs: i64,
    jobs_succeeded: i64,
    attempt_rows: i64,
    jobs_of_backlog_keys: i64,
}

/// The drain: one worker, started with the backlog waiting, until every job's
/// `job.succeeded` event has arrived; then what the worker, the mock and the
/// database counted.
async fn drain_backlog(
    env: &TestEnv,
    config: &Path,
    provider: &MockHandle,
    events: &Events,
    options: &Options,
) -> Drained {
    // Only the worker touches the run's database from here on.
    env.store.close().await;
    let before = settled_counts(&env.name).await;
    let calls_before = provider.stats.requests();
    let log = options.out.join("worker-drain.log");
    let cpu_before = CpuClock::now();
    let started = Instant::now();
    let mut worker = Worker::start(env, config, &log, Some(free_port()));
    let progress = bar(options.n as u64, "draining");
    let limit = Duration::from_secs(120 + options.n as u64 / 20);
    while events.succeeded() < options.n {
        assert_eq!(
            events.other(),
            0,
            "a job ended otherwise than succeeded; see {}",
            log.display()
        );
        assert!(
            started.elapsed() < limit,
            "the drain did not finish within {limit:?}: {} of {} succeeded; see {}",
            events.succeeded(),
            options.n,
            log.display()
        );
        assert!(
            worker.running(),
            "the worker exited during the drain; see {}",
            log.display()
        );
        progress.set_position(events.succeeded() as u64);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = CpuClock::now().since(&cpu_before, options.n);
    progress.finish_and_clear();
    let usage = worker.usage();
    let metrics = worker.metrics().await;
    let batches = metrics.batch_means();
    let answered = |outcome: &str| {
        let n = metrics.value("onejob_intents_total", &format!("outcome=\"{outcome}\""));
        if n.is_nan() { 0 } else { n as u64 }
    };
    let (intents_created, intents_duplicate) = (answered("created"), answered("duplicate"));
    let provider_calls = provider.stats.requests() - calls_before;
    worker.stop().await;
    let counted = settled_counts(&env.name).await - before;
    let (jobs, jobs_succeeded, attempt_rows) = counts(env).await;
    let jobs_of_backlog_keys = backlog_jobs(env, options.n).await;
    say(&format!(
        "drained {} jobs in {seconds:.1} s: {:.0} jobs/s",
        options.n,
        options.n as f64 / seconds
    ));
    Drained {
        seconds,
        usage,
        cpu,
        batches,
        intents_created,
        intents_duplicate,
        provider_calls,
        commits: counted.commits,
        row_writes: counted.row_writes,
        jobs,
        jobs_succeeded,
        attempt_rows,
        jobs_of_backlog_keys,
    }
}

/// One load of the latency phase.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadPhase {
    pub rate_per_s: f64,
    pub latency: Percentiles,
    /// How late after its due time each publish was confirmed.
    pub publish_lag: Percentiles,
    /// The worker's CPU time over the phase, per job.
    pub worker_cpu_ms_per_job: f64,
    /// The machine's CPU over the phase, per job, by program.
    pub cpu: CpuPerJob,
}

/// The latency phase: a fresh worker, and intents published on a fixed
/// schedule at each of `loads` (a rate and the keys' prefix) in turn, on a
/// database vacuumed after the drain. Each
/// load's latencies and the worker's CPU per job, the stages as the worker
/// timed them, and the stages from the database's timestamps (of the keys
/// `l-`, the load the target is set at).
async fn latency_phase(
    env: &TestEnv,
    config: &Path,
    producer: &Arc<Producer>,
    events: &mut Events,
    loads: &[(f64, &str)],
    options: &Options,
) -> (Vec<LoadPhase>, Vec<WorkerStage>, Vec<(String, Percentiles)>) {
    settle_after_the_drain(&env.database_url).await;
    let log = options.out.join("worker-latency.log");
    let mut worker = Worker::start(env, config, &log, Some(free_port()));
    worker.wait_ready().await;
    let mut phases = Vec::new();
    let mut timings = Vec::new();
    for &(rate, prefix) in loads {
        say(&format!(
            "latency: {rate:.0} intents/s for {} s, open loop",
            options.latency_seconds
        ));
        let before = worker.usage().cpu_seconds;
        let cpu_before = CpuClock::now();
        let measured = open_loop(
            producer.clone(),
            events,
            rate,
            options.latency_seconds,
            prefix,
        )
        .await;
        let cpu = worker.usage().cpu_seconds - before;
        phases.push(LoadPhase {
            cpu: CpuClock::now().since(&cpu_before, measured.latency.samples),
            rate_per_s: rate,
            worker_cpu_ms_per_job: cpu * 1000.0 / measured.latency.samples.max(1) as f64,
            latency: measured.latency,
            publish_lag: measured.publish_lag,
        });
        if prefix == "l-" {
            timings = measured.timings;
        }
    }
    let worker_stages = worker.metrics().await.stages();
    worker.stop().await;
    let stages = stages(env, &timings).await;
    (phases, worker_stages, stages)
}
