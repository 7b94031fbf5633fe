//! The README's first job, run as written: its `sh` blocks in one shell, on a
//! fleet of the test's own (the mock provider, every role and the gateway, on
//! the test's database and vhost), each block's output matched against the
//! `text` block that follows it.
//!
//! Three things differ from a reader's run, and only these: the gateway's
//! address stands for 127.0.0.1:8080, the configuration names the test's
//! mock instead of 127.0.0.1:8081, and a UUID the README shows in an output
//! stands, in the commands after it, for the one the real output had there.
//! In an expected output a UUID matches any UUID (the same one each time it
//! recurs), `…` any text within a line, and a line `...` any lines.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use onejob::edges::shutdown::Shutdown;
use onejob::mock::MockOptions;
use onejob::settings::config::EMBEDDED_DEFAULT;
use onejob_producer::gateway::{Gateway, GatewayOptions};

use super::common::{TestEnv, config, mock};
use super::markdown::{blocks, section};
use super::programs::bin_dir;

const DONE: &str = "__onejob_docs_block_done__";

/// One bash, fed a block at a time.
struct Shell {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Shell {
    fn start(env: &TestEnv, config: &std::path::Path) -> Shell {
        let path = format!(
            "{}:{}",
            bin_dir().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut child = Command::new("bash")
            .args(["--noprofile", "--norc"])
            .current_dir(super::root())
            .env("PATH", path)
            .env("DATABASE_URL", &env.database_url)
            .env("AMQP_URL", &env.amqp_url)
            .env("ONEJOB_CONFIG", config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("bash");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Shell {
            child,
            stdin,
            lines,
        }
    }

    /// Runs a block; returns its output and the status of its last command.
    fn run(&mut self, block: &str) -> (Vec<String>, i32) {
        writeln!(self.stdin, "{block}\nprintf '\\n%s %s\\n' {DONE} $?").expect("write to bash");
        let mut out = Vec::new();
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no end of the block within 60 s:\n{block}\n{out:#?}"));
            if let Some(status) = line.strip_prefix(DONE) {
                while out.last().is_some_and(|l: &String| l.trim().is_empty()) {
                    out.pop();
                }
                return (out, status.trim().parse().unwrap_or(-1));
            }
            out.push(line);
        }
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The mock, every role and the gateway on `env`; the gateway's address.
async fn fleet(
    env: &TestEnv,
    config: Arc<onejob::settings::config::Config>,
) -> (super::common::Fleet, String, Shutdown) {
    let fleet = env.fleet(config.clone(), vec![]).await;
    let gateway = Gateway::connect(
        config,
        &env.database_url,
        &env.amqp_url,
        GatewayOptions::default(),
    )
    .await
    .expect("the gateway connects");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let shutdown = Shutdown::new();
    tokio::spawn(Arc::new(gateway).serve(listener, None, shutdown.clone()));
    (fleet, addr, shutdown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readmes_first_job_runs_as_written() {
    let provider = mock(MockOptions::default()).await;
    let text = EMBEDDED_DEFAULT.replace("http://127.0.0.1:8081/v1", &provider.base_url());
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let (fleet, gateway, stop_gateway) = fleet(&env, config).await;
    let readme = super::read(&super::root().join("README.md"));
    let steps = steps(section(&readme, "A first job"));
    assert!(
        steps.len() >= 4,
        "too few steps in the README's first job: {steps:#?}"
    );
    let shell_env = (env, file);
    let mut shell = Shell::start(&shell_env.0, &shell_env.1.path);
    let mut uuids = BTreeMap::new();
    for (commands, expected) in &steps {
        let command = substitute(commands, &uuids).replace("127.0.0.1:8080", &gateway);
        run_until_it_matches(&mut shell, &command, expected, &mut uuids);
    }
    drop(shell);
    stop_gateway.trigger();
    fleet.stop().await;
}

/// Runs a block until its output matches (a job may still be running at the
/// first look), for at most 30 s; a command that fails fails at once.
fn run_until_it_matches(
    shell: &mut Shell,
    command: &str,
    expected: &[String],
    uuids: &mut BTreeMap<String, String>,
) {
    let start = Instant::now();
    loop {
        let (out, status) = shell.run(command);
        let mut bound = uuids.clone();
        if status == 0 && matches(expected, &out, &mut bound) {
            *uuids = bound;
            return;
        }
        assert!(
            status == 0 && start.elapsed() < Duration::from_secs(30),
            "the README's\n{command}\nexited {status} and printed\n{}\nnot\n{}",
            out.join("\n"),
            expected.join("\n")
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The section's `sh` blocks, each with the `text` block after it (an empty
/// expectation when none follows).
fn steps(section: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for block in blocks(section) {
        match block.language() {
            "sh" => out.push((block.text.clone(), Vec::new())),
            "text" => {
                let last = out
                    .last_mut()
                    .expect("an output block after a command block");
                last.1 = block.text.lines().map(str::to_owned).collect();
            }
            other => panic!("a {other} block in the README's first job"),
        }
    }
    out
}

/// Whether `text` is a UUID.
fn is_uuid(text: &str) -> bool {
    text.len() == 36
        && text.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// `text` with every UUID that an output bound replaced by what it bound.
fn substitute(text: &str, uuids: &BTreeMap<String, String>) -> String {
    uuids
        .iter()
        .fold(text.to_owned(), |t, (doc, real)| t.replace(doc, real))
}

/// Whether output lines match expected ones (`...` lines skip any lines).
fn matches(expected: &[String], actual: &[String], uuids: &mut BTreeMap<String, String>) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((e, rest)) if e.trim() == "..." => (0..=actual.len()).any(|skip| {
            let mut tried = uuids.clone();
            let ok = matches(rest, &actual[skip..], &mut tried);
            if ok {
                *uuids = tried;
            }
            ok
        }),
        Some((e, rest)) => match actual.split_first() {
            Some((a, more)) => {
                let mut tried = uuids.clone();
                let ok = line_matches(e.trim_end(), a.trim_end(), &mut tried)
                    && matches(rest, more, &mut tried);
                if ok {
                    *uuids = tried;
                }
                ok
            }
            None => false,
        },
    }
}

/// Whether one line matches: `…` is any text, a UUID any UUID (bound to the
/// first it matched).
fn line_matches(expected: &str, actual: &str, uuids: &mut BTreeMap<String, String>) -> bool {
    if let Some(rest) = expected.strip_prefix('…') {
        return (0..=actual.len())
            .filter(|&i| actual.is_char_boundary(i))
            .any(|i| line_matches(rest, &actual[i..], uuids));
    }
    if let Some(doc) = expected.get(..36).filter(|e| is_uuid(e)) {
        let rest = &expected[36..];
        let Some(real) = actual.get(..36).filter(|a| is_uuid(a)) else {
            return false;
        };
        if uuids.get(doc).is_some_and(|bound| bound != real) {
            return false;
        }
        let mut tried = uuids.clone();
        tried.insert(doc.to_owned(), real.to_owned());
        let ok = line_matches(rest, &actual[36..], &mut tried);
        if ok {
            *uuids = tried;
        }
        return ok;
    }
    match (expected.chars().next(), actual.chars().next()) {
        (None, None) => true,
        (Some(e), Some(a)) if e == a => {
            line_matches(&expected[e.len_utf8()..], &actual[a.len_utf8()..], uuids)
        }
        _ => false,
    }
}

#[test]
fn outputs_match_as_the_readme_means() {
    let mut uuids = BTreeMap::new();
    let id = "01a23704-58f3-704f-a3f9-7a8c8dfde246";
    let expected = vec![
        format!("job {id}  succeeded"),
        "...".into(),
        "  result …}".into(),
    ];
    let actual: Vec<String> = [
        "job 0193e3b4-7c51-7d2a-9c1e-2b8f0a4d6e11  succeeded",
        "  owner  a",
        "  result {\"x\": 1}",
    ]
    .map(str::to_owned)
    .to_vec();
    assert!(matches(&expected, &actual, &mut uuids));
    assert_eq!(uuids[id], "0193e3b4-7c51-7d2a-9c1e-2b8f0a4d6e11");
    let again = vec![format!("job {id}  succeeded")];
    let other = vec!["job 0193e3b4-7c51-7d2a-9c1e-2b8f0a4d6e12  succeeded".to_owned()];
    assert!(
        !matches(&again, &other, &mut uuids),
        "a UUID is the same each time it recurs"
    );
    let longer = [actual[0].clone(), "extra".to_owned()];
    assert!(
        !matches(&again, &longer, &mut uuids),
        "every line is matched"
    );
}
