//! The programs stop on SIGTERM whatever their log sink does: a log shipper
//! that died, or `scripts/fleet 2>&1 | tee` after a Ctrl-C, leaves stdout and
//! stderr a pipe whose reader has gone.

use onejob_test_support as common;

use std::io::Read;
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::binaries::{Program, binary, listening};
use common::throwaway::free_port;
use common::{TestEnv, config, config_text};

/// Starts `command` with stdout and stderr one pipe, waits until it is ready
/// (`/readyz` on `port`), closes the pipe's reading end (after reading what was
/// there), sends SIGTERM, and asserts that the program exits within 20 s, and
/// cleanly (status 0: not by a panic, nor by the signal's default action).
fn stops_with_its_reader_gone(what: &str, mut command: Command, port: u16) {
    let (mut reader, writer) = std::io::pipe().expect("a pipe");
    let mut program = Program(
        command
            .stdin(Stdio::null())
            .stdout(writer.try_clone().expect("clone the pipe"))
            .stderr(writer)
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}")),
    );
    let child = &mut program.0;
    // The parent's copies of the writing end are gone with `command`.
    drop(command);
    listening(port, child);
    // Read what is there without blocking for more, then hang up.
    let said = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        let n = reader.read(&mut buf).unwrap_or(0);
        drop(reader);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    })
    .join()
    .unwrap();
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let began = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(
                status.success(),
                "{what} stopped with {status} after SIGTERM with its log reader gone: it should finish and exit 0; it had said:\n{said}"
            );
            println!(
                "{what}: stopped {:.2}s after SIGTERM ({status}) with its log reader gone",
                began.elapsed().as_secs_f64()
            );
            return;
        }
        if began.elapsed() > Duration::from_secs(20) {
            panic!(
                "{what} did not stop within 20 s of SIGTERM with its log reader gone; it had said:\n{said}"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn with_env(mut command: Command, env: &TestEnv, config_path: &std::path::Path) -> Command {
    command
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", config_path)
        .env("RUST_LOG", "info");
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_stops_on_sigterm_with_its_log_reader_gone() {
    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let (listen, probes) = (free_port(), free_port());
    let mut gateway = Command::new(binary("onejob-producer"));
    gateway.args([
        "serve",
        "--listen",
        &format!("127.0.0.1:{listen}"),
        "--http",
        &format!("127.0.0.1:{probes}"),
    ]);
    let gateway = with_env(gateway, &env, &file.path);
    tokio::task::spawn_blocking(move || stops_with_its_reader_gone("the gateway", gateway, probes))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_stops_on_sigterm_with_its_log_reader_gone() {
    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let probes = free_port();
    let mut worker = Command::new(binary("onejob-worker"));
    worker.args(["--http", &format!("127.0.0.1:{probes}")]);
    let worker = with_env(worker, &env, &file.path);
    tokio::task::spawn_blocking(move || stops_with_its_reader_gone("the worker", worker, probes))
        .await
        .unwrap();
}

/// `scripts/fleet` in a process group of its own, as a terminal runs it, with
/// this test's database, vhost and configuration and its own ports; its output
/// in `log`.
fn fleet(
    env: &TestEnv,
    config_path: &std::path::Path,
    mock: u16,
    log: &std::path::Path,
) -> (Program, u16) {
    fleet_with(env, config_path, mock, log, |_| {})
}

/// As [`fleet`], run by `bash` with the arguments `shell` gives it (none:
/// `scripts/fleet` itself).
fn fleet_with(
    env: &TestEnv,
    config_path: &std::path::Path,
    mock: u16,
    log: &std::path::Path,
    shell: impl FnOnce(&mut Command),
) -> (Program, u16) {
    use std::os::unix::process::CommandExt;
    let probes = free_port();
    let out = std::fs::File::create(log).expect("fleet log");
    let mut command = Command::new("bash");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/fleet");
    let mut given = false;
    shell(&mut command);
    if command.get_args().next().is_some() {
        given = true;
    }
    if !given {
        command.arg(script);
    }
    let child = command
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", config_path)
        // scripts/test built them; a build here would wait for any other.
        .env("ONEJOB_FLEET_BUILD", "0")
        .env("MOCK_LISTEN", format!("127.0.0.1:{mock}"))
        .env("ONEJOB_FLEET_MOCK_DELAY", "4s")
        .env("ONEJOB_FLEET_HTTP", format!("127.0.0.1:{probes}"))
        .env("ONEJOB_FLEET_GATEWAY", format!("127.0.0.1:{}", free_port()))
        .env(
            "ONEJOB_FLEET_GATEWAY_HTTP",
            format!("127.0.0.1:{}", free_port()),
        )
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .process_group(0)
        .spawn()
        .expect("run scripts/fleet");
    (Program(child), probes)
}

/// Waits (60 s at most) for `log` to hold a line with `words`, and returns it.
fn said_in(log: &std::path::Path, words: &str) -> String {
    let began = Instant::now();
    loop {
        let said = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(line) = said.lines().find(|l| l.contains(words)) {
            return line.to_owned();
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "no {words:?} within 60 s:\n{said}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What a terminal does on Ctrl-C: SIGINT to the foreground process group,
/// here `fleet`'s; then waits (60 s at most) for it to exit.
fn ctrl_c(mut fleet: Program) -> std::process::ExitStatus {
    let group = format!("-{}", fleet.0.id());
    let sent = Command::new("kill")
        .args(["-INT", "--", &group])
        .status()
        .unwrap();
    assert!(sent.success());
    let began = Instant::now();
    loop {
        if let Some(status) = fleet.0.try_wait().unwrap() {
            return status;
        }
        if began.elapsed() > Duration::from_secs(60) {
            // Dropping `fleet` kills it and the programs it started.
            panic!("scripts/fleet did not stop within 60 s of Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Ctrl-C in the terminal that runs `scripts/fleet` (SIGINT to its whole
/// process group) while ten calls of 4 s are in flight: the worker finishes
/// them before the mock provider stops, so no attempt ends `unknown`, and
/// every program is gone afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_in_the_fleet_during_a_burst_leaves_no_attempt_unknown() {
    let mock = free_port();
    let text = common::config_for(
        &[common::P(
            "primary",
            &format!("http://127.0.0.1:{mock}/v1"),
            "timeout = \"15s\"",
        )],
        "",
    )
    .replace("shutdown_grace = \"5s\"", "shutdown_grace = \"30s\"")
    .replace("concurrency = 8", "concurrency = 16");
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let log = std::env::temp_dir().join(format!("onejob-fleet-{}.log", env.name));
    let (mut fleet, probes) = fleet(&env, &file.path, mock, &log);
    // A panic from here on drops `fleet`, which kills what it started.
    let fleet = tokio::task::spawn_blocking(move || {
        listening(probes, &mut fleet.0);
        fleet
    })
    .await
    .unwrap();

    let producer = onejob_producer::Producer::connect(&env.amqp_url)
        .await
        .unwrap();
    for i in 0..10 {
        let intent = common::intent("acct_c", &format!("burst-{i}"), "in flight at Ctrl-C");
        producer.publish_only(&intent).await.unwrap();
    }
    producer.close().await;
    common::wait_for("ten calls in flight", Duration::from_secs(30), || async {
        let started: i64 =
            sqlx::query_scalar("SELECT count(*) FROM attempts WHERE status = 'started'")
                .fetch_one(env.store.pool())
                .await
                .unwrap();
        (started == 10).then_some(())
    })
    .await;

    let ready = said_in(&log, "fleet: ready: mock provider http://");
    assert!(
        ready.contains("/readyz") && ready.contains("gateway http://"),
        "{ready}"
    );
    let status = tokio::task::spawn_blocking(move || ctrl_c(fleet))
        .await
        .unwrap();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "scripts/fleet exited {status}:\n{said}");
    assert!(said.contains("fleet: stopped"), "{said}");

    let counts: Vec<(String, i64)> =
        sqlx::query_as("SELECT status::text, count(*) FROM attempts GROUP BY 1 ORDER BY 1")
            .fetch_all(env.store.pool())
            .await
            .unwrap();
    assert_eq!(
        counts,
        vec![("succeeded".to_owned(), 10)],
        "every call in flight at Ctrl-C finished before the mock stopped:\n{said}"
    );
    // Nothing of the fleet is left: the mock's port is free again.
    assert!(
        TcpStream::connect(("127.0.0.1", mock)).is_err(),
        "the mock provider still listens after scripts/fleet exited"
    );
    let _ = std::fs::remove_file(&log);
}

/// `scripts/fleet` started in the background by a script inherits SIGINT
/// ignored, which no trap can undo: it says so at start, and how to stop it;
/// SIGTERM then stops it in order, and it says when it has stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_backgrounded_by_a_script_says_to_stop_it_with_sigterm() {
    let mock = free_port();
    let (config, file) = config(&common::config_text(
        &format!("http://127.0.0.1:{mock}/v1"),
        None,
        "",
    ));
    let env = TestEnv::new(&config).await;
    let log = std::env::temp_dir().join(format!("onejob-fleet-bg-{}.log", env.name));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/fleet");
    // As a script backgrounds it: `fleet &` in a non-interactive shell.
    let (mut shell, _) = fleet_with(&env, &file.path, mock, &log, |c| {
        c.arg("-c").arg(format!("{script} & echo $! >&2; wait"));
    });
    let warned = said_in(&log, "SIGINT is ignored");
    assert!(warned.contains("SIGTERM"), "{warned}");
    said_in(&log, "fleet: ready:");
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    let pid = said
        .lines()
        .find(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_digit()))
        .expect("the fleet's pid")
        .to_owned();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::task::spawn_blocking(move || {
        let began = Instant::now();
        loop {
            if let Some(status) = shell.0.try_wait().unwrap() {
                return status;
            }
            assert!(began.elapsed() < Duration::from_secs(60), "did not stop");
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .unwrap();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{status}:\n{said}");
    assert!(said.contains("fleet: stopped"), "{said}");
    let _ = std::fs::remove_file(&log);
}
