//! The drain benchmark's report: the percentiles of each measure, the
//! targets and whether this run met them, as markdown and JSON.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::peer::PeerFigures;
use super::{LoadPhase, WorkerStage};
use crate::TestEnv;

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
    /// Rows inserted, updated and deleted in the run's database (pg_stat_database).
    pub row_writes_per_job: f64,
    /// The broker's own ceiling: a publish-confirm-consume loop through a quorum
    /// queue, in jobs per second at `messages_per_job`.
    pub broker_ceiling_jobs_per_s: f64,
    pub messages_per_job: usize,
    pub drain_over_broker: f64,
    pub worker_cpu_ms_per_job: f64,
    /// The machine's CPU per job during the drain, by program.
    pub drain_cpu: super::CpuPerJob,
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
    /// The latency at a light load, as the peer's is measured too.
    pub light_rate_per_s: f64,
    pub latency_light: Percentiles,
    /// Every load of the latency phase.
    pub phases: Vec<LoadPhase>,
    /// The latency by stage, from the database's timestamps.
    pub stages: Vec<(String, Percentiles)>,
    /// The latency phase's stages as the worker timed them.
    pub worker_stages: Vec<WorkerStage>,
    pub p99_over_parts: f64,
    /// graphile-worker, in the same run.
    pub peer: PeerFigures,
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
                measure: format!(
                    "drain / the broker's ceiling ({} messages a job), same run",
                    self.messages_per_job
                ),
                value: format!(
                    "{:.2} ({:.0} / {:.0} jobs/s)",
                    self.drain_over_broker, self.drain_jobs_per_s, self.broker_ceiling_jobs_per_s
                ),
                target: "≥ 0.7",
                met: self.drain_over_broker >= 0.7,
            },
            self.cpu_at_quarter_load(),
            Target {
                measure: "drain / graphile-worker's drain, same run".into(),
                value: format!("{:.2}", self.over_peer()),
                target: "≥ 1.5",
                met: self.over_peer() >= 1.5,
            },
            self.against_peer(0, &self.latency_light),
            self.against_peer(1, &self.latency),
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

    /// The worker's CPU per job at a quarter of the drain rate, against at
    /// saturation (the drain).
    fn cpu_at_quarter_load(&self) -> Target {
        let quarter = self
            .phases
            .get(1)
            .map_or(f64::NAN, |p| p.worker_cpu_ms_per_job);
        let ratio = quarter / self.worker_cpu_ms_per_job;
        Target {
            measure: "worker CPU per job at 25% load / at 100%".into(),
            value: format!(
                "{ratio:.2} ({quarter:.3} / {:.3} ms)",
                self.worker_cpu_ms_per_job
            ),
            target: "≤ 2",
            met: ratio <= 2.0,
        }
    }

    fn over_peer(&self) -> f64 {
        self.drain_jobs_per_s / self.peer.drain_jobs_per_s
    }

    /// onejob's p50 and p99 (due → event) over the peer's (due → result) at
    /// the `i`th load both were measured at.
    fn against_peer(&self, i: usize, onejob: &Percentiles) -> Target {
        let (rate, peer) = self.peer.latency[i].clone();
        let (p50, p99) = (onejob.p50_ms / peer.p50_ms, onejob.p99_ms / peer.p99_ms);
        Target {
            measure: format!(
                "at {rate:.0} jobs/s, p50 and p99 due → event / graphile-worker's due → result"
            ),
            value: format!("{p50:.2} and {p99:.2}"),
            target: "≤ 1.0 both",
            met: p50 <= 1.0 && p99 <= 1.0,
        }
    }

    /// The peer's figures, as rows of the figures table.
    fn peer_rows(&self) -> String {
        let ms = |p: &Percentiles| format!("{:.2} / {:.2} / {:.2}", p.p50_ms, p.p99_ms, p.p999_ms);
        let p = &self.peer;
        let mut rows = format!(
            "| graphile-worker drain: worker start → every result | {:.0} jobs/s ({:.1} s) |\n\
             | graphile-worker CPU (node) / peak RSS / commits / row writes | {:.3} ms per job / {:.1} MiB / {:.3} / {:.2} per job |\n\
             | the machine's CPU per job while graphile-worker drained, by program | {} |\n",
            p.drain_jobs_per_s,
            p.drain_seconds,
            p.cpu_ms_per_job,
            p.peak_rss_mib,
            p.commits_per_job,
            p.row_writes_per_job,
            p.cpu.line()
        );
        for ((rate, latency), lag) in p.latency.iter().zip(&p.add_lag) {
            rows.push_str(&format!(
                "| graphile-worker at {rate:.0} jobs/s: due → result p50 / p99 / p99.9; due → add_job returned | {} ms; {} ms |\n",
                ms(latency),
                ms(lag)
            ));
        }
        rows
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
             | row writes (inserted, updated, deleted) | {:.2} per job |\n\
             | worker CPU | {:.3} ms per job |\n\
             | the machine's CPU per job while draining, by program | {} |\n\
             | worker peak RSS | {:.1} MiB |\n\
             | mean batch: intake / claim / settle | {:.1} / {:.1} / {:.1} |\n\
             | broker hop (publish, confirm, delivery) p50 / p99 / p99.9 | {} ms |\n\
             | commit (one-row INSERT) p50 / p99 / p99.9 | {} ms |\n\
             | provider call (mock, HTTP) p50 / p99 / p99.9 | {} ms |\n\
             | parts' p99: 2 hops + 2 commits + 1 call | {:.2} ms |\n",
            self.pgbench_jobs_per_s,
            self.drain_jobs_per_s,
            self.drain_seconds,
            self.commits,
            self.commits_per_job,
            self.row_writes_per_job,
            self.worker_cpu_ms_per_job,
            self.drain_cpu.line(),
            self.worker_peak_rss_mib,
            self.intake_batch_mean,
            self.claim_batch_mean,
            self.settle_batch_mean,
            ms(&self.hop),
            ms(&self.commit),
            ms(&self.call),
            self.parts_p99_sum_ms,
        ));
        for phase in &self.phases {
            md.push_str(&format!(
                "| at {:.0} intents/s: due → event p50 / p99 / p99.9; due → publish confirmed; worker CPU | {} ms; {} ms; {:.3} ms per job |\n",
                phase.rate_per_s,
                ms(&phase.latency),
                ms(&phase.publish_lag),
                phase.worker_cpu_ms_per_job
            ));
            md.push_str(&format!(
                "| at {:.0} intents/s: the machine's CPU per job, by program | {} |\n",
                phase.rate_per_s,
                phase.cpu.line()
            ));
        }
        md.push_str(&self.peer_rows());
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
