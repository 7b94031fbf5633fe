//! Servers of a test's own, for the tests that stop, restart or kill them: a
//! PostgreSQL started from a fresh data directory (`initdb`, `pg_ctl`) on a free
//! port, and RabbitMQ nodes started by `scripts/cluster` in a directory and on
//! ports of their own. The services that were running before are never touched;
//! each server is stopped and its directory removed when the test ends, pass or
//! fail.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A port nobody listens on now, from the kernel's ephemeral range: it could be
/// taken before it is used, which a server's start would then say.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

/// `count` consecutive ports in 10000-12499 that are free, each with port +
/// 20000 free too (`scripts/cluster` puts a node's Erlang distribution there):
/// below the kernel's ephemeral range (32768 up), so that no outgoing
/// connection takes one meanwhile.
pub fn free_cluster_ports(count: u16) -> u16 {
    let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
    for _ in 0..200 {
        let first = 10000 + (rand::random::<u16>() % 2500);
        if (first..first + count).all(|p| free(p) && free(p + 20000)) {
            return first;
        }
    }
    panic!("no {count} free ports (and their +20000) in 10000-12499");
}

/// What a command printed, or why it failed.
fn run(what: &str, out: std::io::Result<Output>) -> Result<String, String> {
    let out = out.map_err(|e| format!("{what}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn checked(what: &str, out: std::io::Result<Output>) -> String {
    run(what, out).unwrap_or_else(|e| panic!("{e}"))
}

/// A server's start, tried three times: the port it was given may have been
/// taken since it was found free.
fn with_retries<T>(what: &str, mut start: impl FnMut() -> Result<T, String>) -> T {
    let mut errors = Vec::new();
    for _ in 0..3 {
        match start() {
            Ok(started) => return started,
            Err(e) => errors.push(e),
        }
    }
    panic!("{what} failed three times: {errors:#?}");
}

/// A PostgreSQL server of this test's own: trust authentication for the user
/// `postgres`, on 127.0.0.1 and a free port, its socket in its own directory.
pub struct OwnPostgres {
    dir: PathBuf,
    port: u16,
    bin: PathBuf,
}

impl OwnPostgres {
    /// `initdb` and start; about two seconds.
    pub fn start() -> OwnPostgres {
        let dir =
            std::env::temp_dir().join(format!("onejob-test-pg-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("create the test Postgres directory");
        let mut pg = OwnPostgres {
            dir,
            port: free_port(),
            bin: postgres_bin_dir(),
        };
        // Postgres refuses to run as root: as root, its files and processes
        // belong to the `postgres` user.
        if running_as_root() {
            checked(
                "chown the test Postgres directory",
                Command::new("chown")
                    .args(["postgres:postgres"])
                    .arg(&pg.dir)
                    .output(),
            );
        }
        checked(
            "initdb",
            pg.as_owner("initdb")
                .args(["--auth=trust", "--username=postgres", "--no-sync", "-D"])
                .arg(pg.data())
                .output(),
        );
        with_retries("starting a test Postgres", || {
            pg.port = free_port();
            pg.try_begin()
        });
        pg
    }

    /// The server's URL, without a database name.
    pub fn base_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn as_owner(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        if running_as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    fn pg_ctl(&self, args: &[&str]) -> Command {
        let mut c = self.as_owner("pg_ctl");
        c.arg("-D").arg(self.data()).args(args);
        c
    }

    /// Starts the stopped server and waits until it takes connections.
    pub fn begin(&self) {
        self.try_begin().unwrap_or_else(|e| panic!("{e}"));
    }

    fn try_begin(&self) -> Result<(), String> {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c max_connections=300",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log");
        run(
            "pg_ctl start",
            self.pg_ctl(&["-w", "-t", "60", "-o", &options, "-l"])
                .arg(&log)
                .arg("start")
                .output(),
        )
        .map(drop)
        .map_err(|e| format!("{e} (see {})", log.display()))
    }

    /// Stops the server (fast: sessions are ended, as a restart would end them).
    pub fn halt(&self) {
        checked(
            "pg_ctl stop",
            self.pg_ctl(&["-w", "-t", "60", "-m", "fast", "stop"])
                .output(),
        );
    }

    /// Stops and starts the server.
    pub fn restart(&self) {
        self.halt();
        self.begin();
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-w", "-m", "immediate", "stop"]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// Where `initdb` and `pg_ctl` are: `$ONEJOB_PG_BIN`, else the directory of the
/// `initdb` on `PATH`, else Debian's newest `/usr/lib/postgresql/N/bin`.
fn postgres_bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("ONEJOB_PG_BIN") {
        return PathBuf::from(dir);
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file())
    });
    if let Some(dir) = on_path {
        return dir;
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("initdb").is_file())
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .expect("initdb not found: install PostgreSQL's server package, or set ONEJOB_PG_BIN")
}

/// RabbitMQ nodes of this test's own, clustered when more than one, through
/// `scripts/cluster` with a directory, node names and ports of their own;
/// stopped, and their directory removed, on drop.
pub struct OwnRabbit(pub Nodes);

impl OwnRabbit {
    /// Starts `nodes` nodes (and joins them); ten seconds or so a node.
    pub fn start(nodes: u16) -> OwnRabbit {
        with_retries("starting test RabbitMQ nodes", || {
            let id = uuid::Uuid::now_v7().simple().to_string();
            let rabbit = OwnRabbit(Nodes {
                dir: std::env::temp_dir().join(format!("onejob-test-rabbit-{id}")),
                // Unique among the nodes on this machine: epmd knows them by name.
                name: format!("onejobt{}", &id[id.len() - 10..]),
                nodes,
                first_port: free_cluster_ports(nodes),
            });
            // A failed start is stopped and removed by the drop.
            run(
                "scripts/cluster start",
                rabbit.command_for(&["start"]).output(),
            )?;
            Ok(rabbit)
        })
    }
}

impl std::ops::Deref for OwnRabbit {
    type Target = Nodes;
    fn deref(&self) -> &Nodes {
        &self.0
    }
}

impl Drop for OwnRabbit {
    fn drop(&mut self) {
        let _ = self.command().arg("stop").output();
    }
}

/// How to reach an [`OwnRabbit`]'s nodes, and `scripts/cluster` for them.
#[derive(Clone, Debug)]
pub struct Nodes {
    dir: PathBuf,
    name: String,
    nodes: u16,
    first_port: u16,
}

impl Nodes {
    /// Runs `scripts/cluster` on these nodes; panics if it fails, and returns
    /// what it printed.
    pub fn script(&self, args: &[&str]) -> String {
        checked(
            &format!("scripts/cluster {args:?}"),
            self.command().args(args).output(),
        )
    }

    /// `scripts/cluster ARGS…` for these nodes, to run.
    pub fn command_for(&self, args: &[&str]) -> Command {
        let mut c = self.command();
        c.args(args);
        c
    }

    fn command(&self) -> Command {
        let mut c = Command::new(crate::binaries::workspace().join("scripts/cluster"));
        c.env("ONEJOB_CLUSTER_DIR", &self.dir)
            .env("ONEJOB_CLUSTER_NAME", &self.name)
            .env("ONEJOB_CLUSTER_NODES", self.nodes.to_string())
            .env("ONEJOB_CLUSTER_PORT", self.first_port.to_string());
        c
    }

    /// Node `node`'s (0-based) AMQP port.
    pub fn port(&self, node: u16) -> u16 {
        self.first_port + node
    }

    /// The URL of node `node` (0-based), on `vhost` (URL-encoded already).
    pub fn url(&self, node: u16, vhost: &str) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/{vhost}", self.port(node))
    }

    /// Every node's URL on `vhost`, starting at node `first`, as one
    /// comma-separated `AMQP_URL`.
    pub fn urls_from(&self, first: u16, vhost: &str) -> String {
        (0..self.nodes)
            .map(|i| self.url((first + i) % self.nodes, vhost))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// rabbitmqctl against node `node` (1-based, as `scripts/cluster` counts).
    pub fn ctl(&self, node: u16, args: &[&str]) -> String {
        let mut all = vec!["ctl".to_owned(), node.to_string()];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        self.script(&all.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Where its data and logs are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}
