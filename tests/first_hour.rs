//! What a new user trips over in the first hour (issue 9): errors that say one
//! thing, in one line, and name the right place.

use onejob_test_support as common;

use std::process::{Command, Stdio};
use std::time::Duration;

fn stderr_lines(out: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// What the broker's refusal of a login says (RabbitMQ's ACCESS_REFUSED); a
/// broker that is not there says none of it ("Connection refused" is the
/// operating system's, not a login's).
fn says_login_refused(line: &str) -> bool {
    line.contains("ACCESS_REFUSED") || line.contains("Login was refused")
}

/// Runs the producer CLI's publish and the operator CLI's `dlq list` against
/// `url`.
fn broker_commands(url: &str) -> [std::process::Output; 2] {
    let producer = Command::new(common::binaries::binary("onejob-producer"))
        .args([
            "publish",
            "--owner",
            "a",
            "--key",
            "k",
            "--operation",
            "summarize",
        ])
        .args(["--input", r#"{"text":"x"}"#])
        .env("AMQP_URL", url)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let cli = Command::new(env!("CARGO_BIN_EXE_onejob"))
        .args(["dlq", "list"])
        .env("AMQP_URL", url)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    [producer, cli]
}

/// A bad AMQP password gets one line from the producer CLI and the operator CLI,
/// naming the broker with the password masked, and saying the login was
/// refused: no lapin recovery logs around it. With no broker there, the same
/// commands say something else, so the line is the broker's answer.
#[test]
fn a_bad_broker_password_is_one_line() {
    let url = "amqp://guest:not-the-password@127.0.0.1:5672/%2f";
    for out in broker_commands(url) {
        assert_eq!(out.status.code(), Some(1));
        let lines = stderr_lines(&out);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("127.0.0.1:5672"), "{lines:?}");
        assert!(!lines[0].contains("not-the-password"), "{lines:?}");
        assert!(
            says_login_refused(&lines[0]),
            "the line must say the broker refused the login: {lines:?}"
        );
    }
    // Nothing listens on port 1: no login was ever tried.
    let unreachable = "amqp://guest:not-the-password@127.0.0.1:1/%2f";
    for out in broker_commands(unreachable) {
        assert_eq!(out.status.code(), Some(1));
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("127.0.0.1:1"), "{text}");
        assert!(!says_login_refused(&text), "{text}");
    }
}

/// Unreachable, a refused login and a missing database are told apart, each
/// with the masked URL, in one line without Postgres's source positions.
#[test]
fn postgres_failures_say_which() {
    let base = common::pg_base();
    let cases = [
        (
            "postgres://postgres:secret@127.0.0.1:1/onejob".to_owned(),
            "cannot reach Postgres at",
        ),
        (
            base.replace("postgres@", "no_such_role@") + "/onejob",
            "refused the login",
        ),
        (format!("{base}/onejob_no_such_db"), "has no such database"),
    ];
    for (url, says) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_onejob"))
            .args(["jobs", "find", "--owner", "a", "--key", "k"])
            .env("DATABASE_URL", &url)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{url}");
        let lines = stderr_lines(&out);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains(says), "{url}: {lines:?}");
        assert!(!lines[0].contains("secret"), "{lines:?}");
        assert!(!lines[0].contains(" at line "), "{lines:?}");
        let host = if url.contains(":1/") {
            "127.0.0.1:1"
        } else {
            "127.0.0.1:5432"
        };
        assert!(lines[0].contains(host), "{lines:?}");
    }
}

/// While it waits for Postgres, the worker says which one it waits for.
#[test]
fn the_worker_names_the_database_it_waits_for() {
    let mut worker = Command::new(common::binaries::binary("onejob-worker"))
        .env(
            "DATABASE_URL",
            "postgres://postgres:secret@127.0.0.1:1/onejob",
        )
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = worker.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.contains("database not reachable yet"))
    });
    let start = std::time::Instant::now();
    while !reader.is_finished() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = worker.kill();
    let _ = worker.wait();
    let line = reader.join().unwrap().expect("a line about the database");
    assert!(line.contains("127.0.0.1:1"), "{line}");
    assert!(!line.contains("secret"), "{line}");
}

/// A second mock provider on a taken port says so in one line, with a hint,
/// even with backtraces asked for.
#[test]
fn a_taken_port_is_one_line_for_the_mock() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_onejob-mock-provider"))
        .args(["--listen", &addr])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains(&addr) && lines[0].contains("already running"),
        "{lines:?}"
    );
}

/// `onejob-producer publish --wait` with a conflict: the receipt is printed
/// as it came (no error in it, as the contract has it), and stderr says what
/// happened and what to do; the exit status is 1. A rejection says its
/// reason there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_conflict_at_the_producer_cli_says_what_happened_and_what_to_do() {
    let (config, _file) = common::config(&common::config_text("http://127.0.0.1:9/v1", None, ""));
    let env = common::TestEnv::new(&config).await;
    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Intake])
        .await;
    let publish = |input: &str, operation: &str| {
        Command::new(common::binaries::binary("onejob-producer"))
            .args(["publish", "--owner", "acct_cli", "--key", "same-key"])
            .args(["--operation", operation, "--input", input, "--wait"])
            .env("AMQP_URL", &env.amqp_url)
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let first = publish(r#"{"text":"first"}"#, "summarize");
    assert_eq!(first.status.code(), Some(0), "{first:?}");
    let conflict = publish(r#"{"text":"second"}"#, "summarize");
    assert_eq!(conflict.status.code(), Some(1), "{conflict:?}");
    let receipt: serde_json::Value = serde_json::from_slice(&conflict.stdout).unwrap();
    assert_eq!(receipt["outcome"], "conflict");
    let said = stderr_lines(&conflict).join("\n");
    assert!(
        said.contains("conflict")
            && said.contains("\"same-key\"")
            && said.contains("new key")
            && said.contains("onejob jobs find"),
        "{said}"
    );
    let rejected = publish(r#"{"text":"x"}"#, "no_such_operation");
    assert_eq!(rejected.status.code(), Some(1), "{rejected:?}");
    let said = stderr_lines(&rejected).join("\n");
    assert!(said.contains("rejected: unknown_operation"), "{said}");
    fleet.stop().await;
}
