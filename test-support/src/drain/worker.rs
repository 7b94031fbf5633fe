//! The `onejob-worker` process a benchmark runs: started with every role,
//! read through its `/metrics` and its `/proc` entry, and stopped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::TestEnv;

/// The worker binary next to the `onejob` binary cargo built for this target
/// (debug for the smoke test, release for the benchmark), or the one
/// `ONEJOB_BENCH_WORKER` names (to compare two builds on one machine).
fn worker_bin() -> PathBuf {
    let bin = std::env::var_os("ONEJOB_BENCH_WORKER").map_or_else(
        || crate::binaries::bin_dir().join("onejob-worker"),
        PathBuf::from,
    );
    assert!(
        bin.exists(),
        "{} is missing: build it first (scripts/bench-drain does; \
         `cargo build --workspace --bins` for the smoke test)",
        bin.display()
    );
    bin
}

/// A worker's `/metrics` text.
pub struct Metrics(String);

impl Metrics {
    /// The value of the first line of `series` that carries `label` (if any).
    pub fn value(&self, series: &str, label: &str) -> f64 {
        self.0
            .lines()
            .filter(|l| l.starts_with(series) && l.contains(label))
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(f64::NAN)
    }

    /// The mean of a histogram's series that carry `label`.
    fn mean(&self, metric: &str, label: &str) -> f64 {
        self.value(&format!("{metric}_sum"), label) / self.value(&format!("{metric}_count"), label)
    }

    /// Mean intake, claim and settle batch sizes.
    pub(super) fn batch_means(&self) -> [f64; 3] {
        [
            self.mean("onejob_intake_batch_size", ""),
            self.mean("onejob_attempt_batch_size", "stage=\"claim\""),
            self.mean("onejob_attempt_batch_size", "stage=\"settle\""),
        ]
    }

    /// Each stage the worker times (`onejob_stage_seconds`): how many, the mean,
    /// and the bucket bound under which 99% fell, in milliseconds, in the order
    /// of the way.
    pub(super) fn stages(&self) -> Vec<WorkerStage> {
        const ORDER: [&str; 11] = [
            "intake_admit",
            "intake_publish",
            "intake_answer",
            "attempt_slot_wait",
            "claim_wait",
            "claim",
            "attempt_call",
            "settle_wait",
            "settle",
            "attempt_ack",
            "settle_publish",
        ];
        let metric = onejob::edges::metrics::STAGE_SECONDS;
        ORDER
            .iter()
            .filter_map(|stage| {
                let label = format!("stage=\"{stage}\"");
                let count = self.value(&format!("{metric}_count"), &label);
                if count.is_nan() || count == 0.0 {
                    return None;
                }
                let mut buckets: Vec<(f64, f64)> = self
                    .0
                    .lines()
                    .filter(|l| l.starts_with(&format!("{metric}_bucket")) && l.contains(&label))
                    .filter_map(|l| {
                        let le = l.split("le=\"").nth(1)?.split('"').next()?;
                        let le = if le == "+Inf" {
                            f64::INFINITY
                        } else {
                            le.parse().ok()?
                        };
                        Some((le, l.rsplit(' ').next()?.parse().ok()?))
                    })
                    .collect();
                buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
                let p99 = buckets
                    .iter()
                    .find(|(_, n)| *n >= 0.99 * count)
                    .map_or(f64::NAN, |(le, _)| le * 1000.0);
                Some(WorkerStage {
                    stage: (*stage).to_owned(),
                    count: count as u64,
                    mean_ms: self.mean(metric, &label) * 1000.0,
                    p99_under_ms: p99,
                })
            })
            .collect()
    }
}

/// One stage as the worker timed it.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerStage {
    pub stage: String,
    pub count: u64,
    pub mean_ms: f64,
    /// The histogram bucket's bound under which 99% fell.
    pub p99_under_ms: f64,
}

/// What the worker process used, from `/proc`.
pub(super) struct Usage {
    pub(super) cpu_seconds: f64,
    pub(super) peak_rss_kib: u64,
}

impl Usage {
    /// What process `pid` has used so far: its CPU time and peak RSS.
    pub(super) fn of(pid: u32) -> Usage {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("process stat");
        // The fields after the command name's closing parenthesis: state is the
        // first, utime and stime the 12th and 13th.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .collect();
        let ticks: f64 = fields
            .get(11..13)
            .map(|f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
            .unwrap_or(0.0);
        let status =
            std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
        let peak_rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
            .unwrap_or(0);
        Usage {
            cpu_seconds: ticks / clock_ticks(),
            peak_rss_kib,
        }
    }
}

/// A worker process with every role.
pub struct Worker {
    child: Child,
    http: Option<u16>,
}

impl Worker {
    pub fn start(env: &TestEnv, config: &Path, log: &Path, http: Option<u16>) -> Worker {
        let log = std::fs::File::create(log).expect("create the worker log");
        let mut cmd = Command::new(worker_bin());
        cmd.env(
            "DATABASE_URL",
            super::database::plaintext(&env.database_url),
        )
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", config)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log handle"))
        .stderr(log);
        if let Some(port) = http {
            cmd.arg("--http").arg(format!("127.0.0.1:{port}"));
        }
        Worker {
            child: cmd.spawn().expect("start onejob-worker"),
            http,
        }
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub async fn wait_ready(&mut self) {
        let port = self.http.expect("started with --http");
        let url = format!("http://127.0.0.1:{port}/readyz");
        let client = reqwest::Client::new();
        let began = Instant::now();
        loop {
            assert!(self.running(), "the worker exited before it was ready");
            if let Ok(r) = client.get(&url).send().await
                && r.status().is_success()
            {
                return;
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "the worker was not ready within a minute"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The worker's `/metrics` text.
    pub async fn metrics(&self) -> Metrics {
        let port = self.http.expect("started with --http");
        let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
            .await
            .expect("worker metrics")
            .text()
            .await
            .expect("worker metrics text");
        Metrics(text)
    }

    pub(super) fn usage(&self) -> Usage {
        Usage::of(self.child.id())
    }

    /// SIGTERM, and waits for the exit (SIGKILL after a minute).
    pub async fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let began = Instant::now();
        while self.running() {
            if began.elapsed() > Duration::from_secs(60) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub(super) fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
