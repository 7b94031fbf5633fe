//! Where the machine's CPU went, program by program: Postgres, RabbitMQ, the
//! worker, this benchmark (its generator, its event watcher and the mock
//! provider) and graphile-worker's node, read from `/proc` before and after a
//! phase. A process that ends within the phase takes its CPU time with it, so
//! the programs' sum can fall short of the machine's busy time; the rest is
//! "other" (the kernel's own threads, and everything else on the machine).

use serde::Serialize;

/// Whether a process name is one program's.
type Named = fn(&str) -> bool;

/// The programs told apart, by their process names.
const PROGRAMS: [(&str, Named); 5] = [
    ("postgres", |comm| comm == "postgres"),
    ("rabbitmq", |comm| {
        comm.starts_with("beam") || comm == "erl_child_setup" || comm == "inet_gethost"
    }),
    ("worker", |comm| comm == "onejob-worker"),
    ("node", |comm| comm == "node" || comm.starts_with("node ")),
    ("benchmark", |_| false),
];

/// CPU seconds used so far: each program's, and the machine's busy time.
#[derive(Clone, Debug)]
pub struct CpuClock {
    programs: [f64; PROGRAMS.len()],
    machine: f64,
}

impl CpuClock {
    pub fn now() -> CpuClock {
        let mut programs = [0.0; PROGRAMS.len()];
        let me = std::process::id();
        let ticks = clock_ticks();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Some((comm, cpu)) = process_cpu(pid) else {
                continue;
            };
            let which = if pid == me {
                Some(PROGRAMS.len() - 1)
            } else {
                PROGRAMS.iter().position(|(_, is)| is(&comm))
            };
            if let Some(i) = which {
                programs[i] += cpu / ticks;
            }
        }
        CpuClock {
            programs,
            machine: machine_busy() / ticks,
        }
    }

    /// What each program used between `earlier` and this reading, per job, in
    /// milliseconds.
    pub fn since(&self, earlier: &CpuClock, jobs: usize) -> CpuPerJob {
        let per_job = |seconds: f64| seconds * 1000.0 / jobs.max(1) as f64;
        let programs: Vec<(String, f64)> = PROGRAMS
            .iter()
            .zip(self.programs.iter().zip(&earlier.programs))
            .map(|((name, _), (now, then))| ((*name).to_owned(), per_job(now - then)))
            .collect();
        let machine = per_job(self.machine - earlier.machine);
        let counted: f64 = programs.iter().map(|(_, ms)| ms).sum();
        CpuPerJob {
            programs,
            other_ms: (machine - counted).max(0.0),
            machine_ms: machine,
        }
    }
}

/// The CPU a phase used per job, by program, in milliseconds.
#[derive(Clone, Debug, Serialize)]
pub struct CpuPerJob {
    pub programs: Vec<(String, f64)>,
    pub other_ms: f64,
    pub machine_ms: f64,
}

impl CpuPerJob {
    /// `postgres 0.31, rabbitmq 0.17, … ; machine 0.71 ms`, leaving out the
    /// programs that used nothing.
    pub fn line(&self) -> String {
        let mut parts: Vec<String> = self
            .programs
            .iter()
            .filter(|(_, ms)| *ms >= 0.0005)
            .map(|(name, ms)| format!("{name} {ms:.3}"))
            .collect();
        parts.push(format!("other {:.3}", self.other_ms));
        format!(
            "{}; the machine {:.3} ms",
            parts.join(", "),
            self.machine_ms
        )
    }
}

/// A process's name and its CPU time (user and system) in clock ticks.
fn process_cpu(pid: u32) -> Option<(String, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = stat.find('(')?;
    let (name, rest) = stat[open + 1..].rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is the first field, utime and stime the 12th and 13th.
    let cpu = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some((name.to_owned(), cpu))
}

/// The machine's busy time in clock ticks: `/proc/stat`'s first line, all but
/// idle, iowait and steal (time the hypervisor gave to another machine).
fn machine_busy() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().next() else {
        return 0.0;
    };
    line.split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse::<f64>().ok())
        .enumerate()
        // user nice system idle iowait irq softirq steal (guest time is in user).
        .filter(|(i, _)| *i < 7 && *i != 3 && *i != 4)
        .map(|(_, v)| v)
        .sum()
}

fn clock_ticks() -> f64 {
    super::worker::clock_ticks()
}
