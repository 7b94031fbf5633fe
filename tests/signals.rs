//! The programs stop on SIGTERM whatever their log sink does: a log shipper
//! that died, or `scripts/fleet 2>&1 | tee` after a Ctrl-C, leaves stdout and
//! stderr a pipe whose reader has gone.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::throwaway::free_port;
use common::{TestEnv, config, config_text};

/// A binary of the workspace, built beside this test.
fn binary(name: &str) -> PathBuf {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_onejob"))
        .parent()
        .unwrap()
        .join(name);
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build --workspace --bins`, as scripts/test does)",
        bin.display()
    );
    bin
}

/// Whether `/readyz` on `port` answers 200.
fn ready(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    if stream
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200")
}

/// Waits until the program's `/readyz` on `port` answers 200 (it is up, its
/// signal handler too), or panics after 60 s.
fn listening(port: u16, child: &mut Child) {
    let began = Instant::now();
    while !ready(port) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the program exited before it listened: {status}");
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "nothing listens on {port} after 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts `command` with stdout and stderr one pipe, waits until it is ready
/// (`/readyz` on `port`), closes the pipe's reading end (after reading what was
/// there), sends SIGTERM, and asserts that the program exits within 20 s, and
/// cleanly (status 0: not by a panic, nor by the signal's default action).
fn stops_with_its_reader_gone(what: &str, mut command: Command, port: u16) {
    let (mut reader, writer) = std::io::pipe().expect("a pipe");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(writer.try_clone().expect("clone the pipe"))
        .stderr(writer)
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    // The parent's copies of the writing end are gone with `command`.
    drop(command);
    listening(port, &mut child);
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
            let _ = child.kill();
            let _ = child.wait();
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
