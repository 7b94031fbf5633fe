//! Secrets (API keys, URL passwords, gateway tokens) never reach logs, errors or
//! `--json` output; a stopping worker finishes what is in flight.

use onejob_test_support as common;

use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::throwaway::OwnRabbit;
use common::{P, Servers, TestEnv, config, config_for, mock, submit, wait_for_status};
use onejob::domain::JobStatus;
use onejob::mock::{MockHandle, MockOptions};
use onejob::settings::config::Config;
use onejob_producer::Producer;

const API_KEY: &str = "sk-live-API-KEY-0123456789abcdef";
const PG_PASSWORD: &str = "pg-PASSWORD-5f3a9c";
const AMQP_PASSWORD: &str = "amqp-PASSWORD-8b1d7e";

/// Log lines written by this test process, captured at debug level.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Capture {
    type Writer = Capture;
    fn make_writer(&'a self) -> Capture {
        self.clone()
    }
}

/// A user with a distinctive password on `rabbit`, a RabbitMQ node of the
/// test's own (users are the node's, not a vhost's: the machine's node is left
/// alone), allowed everything in `vhost`; its URL there.
fn amqp_user(rabbit: &OwnRabbit, vhost: &str) -> String {
    let name = format!("u_{vhost}");
    rabbit.ctl(1, &["add_user", &name, AMQP_PASSWORD]);
    rabbit.ctl(
        1,
        &["set_permissions", "-p", vhost, &name, ".*", ".*", ".*"],
    );
    format!(
        "amqp://{name}:{AMQP_PASSWORD}@127.0.0.1:{}/{vhost}",
        rabbit.port(0)
    )
}

fn assert_clean(what: &str, text: &str) {
    for secret in [API_KEY, PG_PASSWORD, AMQP_PASSWORD] {
        assert!(!text.contains(secret), "{what} leaks a secret:\n{text}");
    }
}

/// The operator CLI at debug level, with the API key in its environment: it
/// asserts that a run's output and logs hold no secret, and returns it.
struct Cli<'a> {
    config: &'a Path,
}

impl Cli<'_> {
    fn run(&self, args: &[&str], db: &str, amqp: &str) -> Output {
        let out = Command::new(env!("CARGO_BIN_EXE_onejob"))
            .args(args)
            .env("DATABASE_URL", db)
            .env("AMQP_URL", amqp)
            .env("ONEJOB_CONFIG", self.config)
            .env("ONEJOB_TEST_API_KEY", API_KEY)
            .env("RUST_LOG", "debug")
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_clean(&format!("onejob {args:?}"), &all);
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn secrets_never_reach_logs_errors_or_json_output() {
    let capture = Capture::default();
    tracing_subscriber::fmt()
        .with_env_filter("debug")
        .with_ansi(false)
        .with_writer(capture.clone())
        .init();

    let primary = mock(MockOptions::default()).await;
    let url = primary.base_url();
    let text = config_for(
        &[P("primary", &url, "api_key_env = \"ONEJOB_TEST_API_KEY\"")],
        "",
    );
    let (config, file) = config(&text);
    let rabbit = OwnRabbit::start(1);
    let env = TestEnv::on(&config, Servers::with_rabbit(&rabbit)).await;
    let amqp_url = amqp_user(&rabbit, &env.name);
    let database_url = env
        .database_url
        .replace("postgres@", &format!("postgres:{PG_PASSWORD}@"));

    // The CLI, at debug level, with the key in its environment: every command's
    // output, --json or not, and its logs.
    let cli = Cli { config: &file.path };
    every_command_is_clean(&cli, &primary, &database_url, &amqp_url);
    unreachable_services_are_masked(&cli, &database_url, &amqp_url);

    // The worker, in this process, at debug level, through a whole job.
    let ctx = onejob::shared::runtime::Context::connect(config.clone(), &database_url, &amqp_url)
        .await
        .unwrap();
    let shutdown = onejob::edges::shutdown::Shutdown::new();
    let task = tokio::spawn(onejob::fleet::run(ctx.clone(), vec![], shutdown.clone()));
    let producer = Producer::connect(&amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_s", "k", "secret-free").await;
    // The key is not in this process's environment: the call fails definitely,
    // naming the variable, never a value.
    let job = wait_for_status(&env, job_id, JobStatus::Failed).await;
    assert!(
        job.error
            .as_deref()
            .unwrap_or("")
            .contains("ONEJOB_TEST_API_KEY"),
        "{:?}",
        job.error
    );

    // The gateway, in this process, at debug level: its tokens are secrets too.
    let secret_part = gateway_tokens_stay_secret(&cli, &config, &database_url, &amqp_url).await;

    shutdown.trigger();
    task.await.unwrap().unwrap();
    producer.close().await;
    let shown = cli.run(
        &["jobs", "show", &job_id.to_string(), "--json"],
        &database_url,
        &amqp_url,
    );
    assert!(shown.status.success());

    let logs = String::from_utf8_lossy(&capture.0.lock().unwrap()).into_owned();
    assert!(
        logs.contains("job created"),
        "the capture saw the worker's logs"
    );
    assert_clean("the worker's logs", &logs);
    assert!(
        logs.contains("intent answered"),
        "the capture saw the gateway's logs"
    );
    assert!(
        !logs.contains(&secret_part),
        "the logs show a gateway token"
    );
}

/// A qualification sends the key to the provider and only there; and every
/// command, `--json` or not, `--help` too, prints no secret.
fn every_command_is_clean(cli: &Cli<'_>, primary: &MockHandle, db: &str, amqp: &str) {
    let qualified = cli.run(&["providers", "qualify", "primary", "--json"], db, amqp);
    assert!(
        qualified.status.success(),
        "{}",
        String::from_utf8_lossy(&qualified.stderr)
    );
    assert_eq!(
        primary.stats.authorizations(),
        vec![format!("Bearer {API_KEY}")],
        "the key was sent to the provider, and only there"
    );
    for args in [
        vec!["config", "check", "--json"],
        vec!["providers", "list", "--json"],
        vec!["dlq", "list", "--json"],
        vec!["jobs", "find", "--owner", "o", "--key", "k", "--json"],
        vec!["--help"],
    ] {
        cli.run(&args, db, amqp);
    }
}

/// Unreachable services: the errors name the URL with its password masked,
/// every URL of a cluster's list included.
fn unreachable_services_are_masked(cli: &Cli<'_>, database_url: &str, amqp_url: &str) {
    let down = cli.run(
        &["jobs", "find", "--owner", "o", "--key", "k"],
        &database_url.replace(":5432", ":1"),
        amqp_url,
    );
    assert_eq!(down.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&down.stderr).contains("***"));
    // The broker's port, in the URL.
    let port = amqp_url
        .split("@127.0.0.1:")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .expect("a port in the AMQP URL");
    let node = |other: &str| amqp_url.replace(&format!(":{port}/"), &format!(":{other}/"));
    let down = cli.run(&["dlq", "list"], database_url, &node("1"));
    assert_eq!(down.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&down.stderr).contains("***"));
    // A list of a cluster's nodes: the CLI takes the first that answers, and
    // every URL of the list is masked wherever it is shown.
    let listed = cli.run(
        &["dlq", "list", "--json"],
        database_url,
        &format!("{},{amqp_url}", node("1")),
    );
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let down = cli.run(
        &["dlq", "list", "--json"],
        database_url,
        &format!("{},{}", node("1"), node("2")),
    );
    assert_eq!(down.status.code(), Some(1));
    let said =
        String::from_utf8_lossy(&down.stderr).into_owned() + &String::from_utf8_lossy(&down.stdout);
    assert!(
        said.matches("***").count() >= 2,
        "both nodes named, masked: {said}"
    );
    let other = amqp_url.replace(AMQP_PASSWORD, "a-second-secret");
    let refused = cli.run(
        &["dlq", "list"],
        database_url,
        &format!("{amqp_url},{other}"),
    );
    assert_eq!(refused.status.code(), Some(1));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("another user, password or virtual host")
            && !said.contains("a-second-secret"),
        "{said}"
    );
}

/// The gateway's tokens are secrets too: a token made by the CLI is shown in
/// no answer, listing or log of the gateway's. Returns its secret part, for
/// the caller to look for in the logs.
async fn gateway_tokens_stay_secret(
    cli: &Cli<'_>,
    config: &Arc<Config>,
    database_url: &str,
    amqp_url: &str,
) -> String {
    let created = cli.run(
        &["tokens", "create", "--owner", "acct_s", "--json"],
        database_url,
        amqp_url,
    );
    let created: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    let token = created["token"].as_str().unwrap().to_owned();
    let secret_part = token["ojt_".len()..].to_owned();
    let gateway = onejob_producer::gateway::Gateway::connect(
        config.clone(),
        database_url,
        amqp_url,
        onejob_producer::gateway::GatewayOptions::default(),
    )
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = onejob::edges::shutdown::Shutdown::new();
    let server = tokio::spawn(Arc::new(gateway).serve(listener, None, stop.clone()));
    let http = reqwest::Client::new();
    let mut answers = String::new();
    for (bearer, key) in [
        (token.clone(), "k-http"),
        (token.clone(), "k-http"),
        // Well-formed, but not a token of this database.
        (
            onejob::settings::token::Token::generate()
                .reveal()
                .to_owned(),
            "k-http",
        ),
    ] {
        let response = http
            .post(format!("{base}/v1/jobs"))
            .bearer_auth(&bearer)
            .header("Idempotency-Key", key)
            .body(r#"{"operation":"summarize","input":{"text":"over http"}}"#)
            .send()
            .await
            .unwrap();
        answers.push_str(&response.text().await.unwrap());
    }
    assert!(
        answers.contains("created") && answers.contains("unauthorized"),
        "{answers}"
    );
    assert!(
        !answers.contains(&secret_part),
        "an answer shows the token: {answers}"
    );
    stop.trigger();
    server.await.unwrap().unwrap();
    let listed = cli.run(&["tokens", "list", "--json"], database_url, amqp_url);
    assert!(listed.status.success());
    assert!(!String::from_utf8_lossy(&listed.stdout).contains(&secret_part));
    secret_part
}

/// On shutdown the worker stops taking deliveries but finishes the call in flight,
/// commits its outcome and acks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_finishes_in_flight_work() {
    let primary = mock(MockOptions {
        delay: Duration::from_millis(1500),
        ..MockOptions::default()
    })
    .await;
    let url = primary.base_url();
    let (config, _file) = config(&config_for(&[P("primary", &url, "timeout = \"10s\"")], ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_g", "k", "graceful").await;
    wait_for_status(&env, job_id, JobStatus::Running).await;
    fleet.stop().await;
    let job = env.store.jobs().job(job_id).await.unwrap().unwrap();
    assert_eq!(
        job.status,
        JobStatus::Succeeded,
        "the call in flight finished before the worker stopped"
    );
    // Its delivery was acked: nothing is left in the attempts queue.
    let amqp = env.amqp().await;
    let ch = amqp.create_channel().await.unwrap();
    assert!(
        env.drain(&ch, &onejob::broker::attempts_queue("primary"))
            .await
            .is_empty()
    );
    producer.close().await;
}

/// Files over this size are junk in a repository (a crash dump, a build output)
/// unless they are a test's fixtures.
const LARGEST_TRACKED_FILE: u64 = 256 * 1024;

/// No tracked file is over 256 KiB, except under a `fixtures/` directory: an
/// `erl_crash.dump` of 715 KB was once committed by mistake.
#[test]
fn no_tracked_file_is_over_256_kib_unless_a_fixture() {
    let root = env!("CARGO_MANIFEST_DIR");
    let listed = Command::new("git")
        .args(["-C", root, "ls-files", "-z"])
        .output()
        .expect("git must be on PATH: this test reads what the repository tracks");
    assert!(
        listed.status.success(),
        "git ls-files: {} (run the tests from a git checkout)",
        String::from_utf8_lossy(&listed.stderr)
    );
    let too_big: Vec<String> = listed
        .stdout
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .filter(|p| !p.split('/').any(|part| part == "fixtures"))
        .filter_map(|p| {
            let size = std::fs::metadata(Path::new(root).join(&p)).ok()?.len();
            (size > LARGEST_TRACKED_FILE).then(|| format!("{p} ({size} bytes)"))
        })
        .collect();
    assert!(
        too_big.is_empty(),
        "tracked files over {LARGEST_TRACKED_FILE} bytes (remove them, or put a test's fixtures under a fixtures/ directory): {too_big:?}"
    );
}
