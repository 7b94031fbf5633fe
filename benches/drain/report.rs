//! The drain benchmark's report: the percentiles of each measure, the
//! targets and whether this run met them, as markdown and JSON.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::WorkerStage;
use crate::common::TestEnv;

/// Latency percentiles, in milliseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Percentiles {
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
}

impl Percentiles {
    pub fn of(mut samples: Vec<Duration>) -> Percentiles {
        samples.sort();
        let at = |q: f64| -> f64 {
            if samples.is_empty() {
                return f64::NAN;
            }
            let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
            samples[rank - 1].as_secs_f64() * 1000.0
        };
        Percentiles {
            samples: samples.len(),
            p50_ms: at(0.50),
            p99_ms: at(0.99),
            p999_ms: at(0.999),
        }
    }
}

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub machine: String,
    pub n: usize,
    pub duplicates: usize,
    pub pgbench_jobs_per_s: f64,
    pub drain_seconds: f64,
    pub drain_jobs_per_s: f64,
    pub drain_over_pgbench: f64,
    pub commits: i64,
    pub commits_per_job: f64,
    pub worker_cpu_ms_per_job: f64,
    pub worker_peak_rss_mib: f64,
    /// Mean intents per intake statement, attempts per claim and per settling
    /// transaction, from the worker's `/metrics`.
    pub intake_batch_mean: f64,
    pub claim_batch_mean: f64,
    pub settle_batch_mean: f64,
    pub jobs: i64,
    pub jobs_succeeded: i64,
    /// Jobs whose identity is one of the backlog's N keys, read back from the
    /// database.
    pub jobs_of_backlog_keys: i64,
    pub attempt_rows: i64,
    pub provider_calls: u64,
    /// How intake answered the backlog's intents, from the draining worker's
    /// `onejob_intents_total`.
    pub intents_created: u64,
    pub intents_duplicate: u64,
    pub hop: Percentiles,
    pub commit: Percentiles,
    pub call: Percentiles,
    pub parts_p99_sum_ms: f64,
    pub latency_load: f64,
    pub latency_rate_per_s: f64,
    pub latency: Percentiles,
    /// The latency by stage, from the database's timestamps.
    pub stages: Vec<(String, Percentiles)>,
    /// The latency phase's stages as the worker timed them.
    pub worker_stages: Vec<WorkerStage>,
    pub p99_over_parts: f64,
}

/// A target and whether this run met it.
struct Target {
    measure: String,
    value: String,
    target: &'static str,
    met: bool,
}

impl Report {
    fn targets(&self) -> Vec<Target> {
        vec![
            Target {
                measure: "drain / B_pg1, same run".into(),
                value: format!("{:.2}", self.drain_over_pgbench),
                target: "≥ 3.0",
                met: self.drain_over_pgbench >= 3.0,
            },
            Target {
                measure: "commits per job at saturation".into(),
                value: format!("{:.3}", self.commits_per_job),
                target: "≤ 0.2",
                met: self.commits_per_job <= 0.2,
            },
            Target {
                measure: format!(
                    "p99 at {:.0}% load / sum of its parts' p99",
                    self.latency_load * 100.0
                ),
                value: format!("{:.2}", self.p99_over_parts),
                target: "≤ 4",
                // The target is set at half the drain rate; met at a lighter load, it
                // is not met.
                met: self.p99_over_parts <= 4.0 && self.latency_load >= 0.5,
            },
            Target {
                measure: "worker peak RSS while draining".into(),
                value: format!("{:.1} MiB (N = {})", self.worker_peak_rss_mib, self.n),
                target: "≤ 100 MiB at N = 100000",
                met: self.worker_peak_rss_mib <= 100.0,
            },
            Target {
                measure: "duplicates: provider calls, attempt rows".into(),
                value: format!(
                    "{} calls, {} attempts for {} jobs",
                    self.provider_calls, self.attempt_rows, self.n
                ),
                target: "one of each per job",
                met: self.provider_calls == self.n as u64 && self.attempt_rows == self.n as i64,
            },
        ]
    }

    /// The report as a markdown table, targets first.
    pub fn markdown(&self) -> String {
        let mut md = format!(
            "drain benchmark on {}\n\n\
             backlog: {} distinct intents + {} duplicates; one onejob-worker, every role, the instant mock provider\n\n\
             | measure | value | target | met |\n|---|---|---|---|\n",
            self.machine, self.n, self.duplicates
        );
        for t in self.targets() {
            md.push_str(&format!(
                "| {} | {} | {} | {} |\n",
                t.measure,
                t.value,
                t.target,
                if t.met { "yes" } else { "**no**" }
            ));
        }
        let ms = |p: &Percentiles| format!("{:.2} / {:.2} / {:.2}", p.p50_ms, p.p99_ms, p.p999_ms);
        md.push_str(&format!(
            "\n| figure | value |\n|---|---|\n\
             | B_pg1: pgbench, onejob's per-job SQL, unbatched, 4 clients | {:.0} jobs/s |\n\
             | drain: worker start → every job succeeded | {:.0} jobs/s ({:.1} s) |\n\
             | commits (pg_stat_database) | {} ({:.3} per job) |\n\
             | worker CPU | {:.3} ms per job |\n\
             | worker peak RSS | {:.1} MiB |\n\
             | mean batch: intake / claim / settle | {:.1} / {:.1} / {:.1} |\n\
             | latency at {:.0} intents/s, publish due → succeeded, p50 / p99 / p99.9 | {} ms ({} jobs) |\n\
             | broker hop (publish, confirm, delivery) p50 / p99 / p99.9 | {} ms |\n\
             | commit (one-row INSERT) p50 / p99 / p99.9 | {} ms |\n\
             | provider call (mock, HTTP) p50 / p99 / p99.9 | {} ms |\n\
             | parts' p99: 2 hops + 2 commits + 1 call | {:.2} ms |\n",
            self.pgbench_jobs_per_s,
            self.drain_jobs_per_s,
            self.drain_seconds,
            self.commits,
            self.commits_per_job,
            self.worker_cpu_ms_per_job,
            self.worker_peak_rss_mib,
            self.intake_batch_mean,
            self.claim_batch_mean,
            self.settle_batch_mean,
            self.latency_rate_per_s,
            ms(&self.latency),
            self.latency.samples,
            ms(&self.hop),
            ms(&self.commit),
            ms(&self.call),
            self.parts_p99_sum_ms,
        ));
        for (stage, p) in &self.stages {
            md.push_str(&format!(
                "| latency stage: {stage}, p50 / p99 / p99.9 | {} ms |\n",
                ms(p)
            ));
        }
        for w in &self.worker_stages {
            md.push_str(&format!(
                "| in the worker: {}, mean / p99 under | {:.2} / {} ms ({} times) |\n",
                w.stage, w.mean_ms, w.p99_under_ms, w.count
            ));
        }
        md
    }

    /// Writes `drain.json` and `drain.md` into `dir`.
    pub fn write(&self, dir: &Path) {
        std::fs::create_dir_all(dir).expect("create the report folder");
        let json = serde_json::to_string_pretty(self).expect("report json");
        std::fs::write(dir.join("drain.json"), json + "\n").expect("write drain.json");
        std::fs::write(dir.join("drain.md"), self.markdown()).expect("write drain.md");
    }
}

/// Cores, memory and the services' versions.
pub async fn machine(env: &TestEnv) -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.trim().trim_end_matches(" kB").parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    let pg: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(env.store.pool())
        .await
        .unwrap_or_default();
    format!("{cores} × {model}, {mem_gib:.0} GiB, PostgreSQL {pg}")
}
