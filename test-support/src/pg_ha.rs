//! A highly available PostgreSQL of a test's own: `scripts/pg-ha` (one
//! etcd, two PostgreSQL nodes under Patroni, HAProxy routing to the
//! primary) in a directory and on ports of its own, stopped and removed when
//! dropped.

use std::path::PathBuf;
use std::process::Command;

/// A running cluster.
pub struct OwnHa {
    dir: PathBuf,
    port: u16,
}

/// Whether Patroni, etcd and HAProxy are installed (`scripts/pg-ha-packages`
/// installs them). Where they are not, a test that needs them says it
/// skipped, and under `CI=true` fails instead: CI installs them.
pub fn installed(test: &str) -> bool {
    let found = ["patroni", "etcd", "haproxy"].iter().all(|p| {
        Command::new("sh")
            .args(["-c", &format!("command -v {p}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: patroni, etcd or haproxy is missing, and under CI=true it may not be skipped: run scripts/pg-ha-packages first (as .ci/run does)"
        );
        eprintln!(
            "{test}: SKIPPED: patroni, etcd or haproxy is missing (scripts/pg-ha-packages installs them)"
        );
    }
    found
}

impl OwnHa {
    /// Starts a cluster, with synchronous replication or without, on free
    /// ports; it has a primary that takes writes through HAProxy and a
    /// standby streaming from it when this returns.
    pub fn start(sync: bool) -> OwnHa {
        let mut errors = Vec::new();
        for _ in 0..3 {
            let ha = OwnHa {
                dir: std::env::temp_dir()
                    .join(format!("onejob-pgha-{}", uuid::Uuid::now_v7().simple())),
                port: free_base(),
            };
            let out = ha
                .command(&["start"])
                .env("ONEJOB_PGHA_SYNC", sync.to_string())
                .output()
                .expect("run scripts/pg-ha");
            if out.status.success() {
                return ha;
            }
            errors.push(String::from_utf8_lossy(&out.stderr).into_owned());
            drop(ha);
        }
        panic!("scripts/pg-ha start failed three times: {errors:?}");
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(crate::binaries::workspace().join("scripts/pg-ha"));
        c.args(args)
            .env("ONEJOB_PGHA_DIR", &self.dir)
            .env("ONEJOB_PGHA_PORT", self.port.to_string());
        c
    }

    /// Runs `scripts/pg-ha ARGS…` on this cluster; panics if it fails, and
    /// returns what it printed.
    pub fn script(&self, args: &[&str]) -> String {
        let out = self.command(args).output().expect("run scripts/pg-ha");
        assert!(
            out.status.success(),
            "scripts/pg-ha {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The server's URL through HAProxy, without a database name.
    pub fn base_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    /// The node (1 or 2) that is primary now.
    pub fn primary(&self) -> u8 {
        self.script(&["primary"]).parse().expect("a node number")
    }

    /// Waits for a primary other than node `old` that takes writes through
    /// HAProxy; which node it is.
    pub fn wait_primary(&self, old: u8) -> u8 {
        self.script(&["wait-primary", &old.to_string()])
            .parse()
            .expect("a node number")
    }

    /// The pids of every process the cluster runs (etcd, HAProxy, each
    /// Patroni and each PostgreSQL), read from its directory.
    pub fn pids(&self) -> Vec<u32> {
        let mut files = vec!["etcd.pid", "haproxy.pid", "patroni1.pid", "patroni2.pid"]
            .into_iter()
            .map(|f| self.dir.join(f))
            .collect::<Vec<_>>();
        files.push(self.dir.join("node1/data/postmaster.pid"));
        files.push(self.dir.join("node2/data/postmaster.pid"));
        files
            .iter()
            .filter_map(|f| std::fs::read_to_string(f).ok())
            .filter_map(|t| t.lines().next()?.trim().parse().ok())
            .collect()
    }

    /// Node `n`'s PostgreSQL processes running now: its postmaster and
    /// the backends and workers it forked.
    pub fn postgres_processes(&self, n: u8) -> Vec<u32> {
        let file = self.dir.join(format!("node{n}/data/postmaster.pid"));
        let Some(postmaster) = std::fs::read_to_string(file)
            .ok()
            .and_then(|t| t.lines().next()?.trim().parse::<u32>().ok())
        else {
            return Vec::new();
        };
        let mut found: Vec<u32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| process(pid).is_some_and(|(_, parent)| parent == postmaster))
            .collect();
        found.push(postmaster);
        found.retain(|&pid| running(pid));
        found
    }

    /// Its directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for OwnHa {
    fn drop(&mut self) {
        let _ = self.command(&["stop"]).output();
    }
}

/// A base port whose seven ports (HAProxy, two nodes, two REST APIs, etcd's
/// two) are all free now.
fn free_base() -> u16 {
    use rand::Rng;
    loop {
        let base: u16 = rand::rng().random_range(20_000..29_000);
        let ports = [
            base,
            base + 1,
            base + 2,
            base + 2577,
            base + 2578,
            base - 3053,
            base - 3052,
        ];
        if ports
            .iter()
            .all(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        {
            return base;
        }
    }
}

/// Whether process `pid` runs: it exists and is not a zombie.
pub fn running(pid: u32) -> bool {
    process(pid).is_some_and(|(state, _)| state != 'Z')
}

/// Whether process `pid` will run none of its own code again: it is gone,
/// a zombie, exiting, or has a SIGKILL pending. (One killed a moment ago
/// may still be on its way out.)
pub fn ended(pid: u32) -> bool {
    const EXITING: u64 = 0x4; // PF_EXITING
    const KILL: u64 = 1 << (9 - 1); // SIGKILL's bit in a pending mask
    let Some((state, _, flags)) = stat(pid) else {
        return true;
    };
    let pending = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("SigPnd:").or(l.strip_prefix("ShdPnd:")))
        .filter_map(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .fold(0, |all, mask| all | mask);
    state == 'Z' || flags & EXITING != 0 || pending & KILL != 0
}

/// A process's state letter and parent pid, from `/proc/PID/stat`, if it
/// exists.
fn process(pid: u32) -> Option<(char, u32)> {
    stat(pid).map(|(state, parent, _)| (state, parent))
}

/// A process's state letter, parent pid and kernel flags, from
/// `/proc/PID/stat`, if it exists.
fn stat(pid: u32) -> Option<(char, u32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name in parentheses may hold spaces: read after its end.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    let state = fields.first()?.chars().next()?;
    let parent = fields.get(1)?.parse().ok()?;
    let flags = fields.get(6)?.parse().ok()?;
    Some((state, parent, flags))
}
