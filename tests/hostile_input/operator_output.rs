//! Outside data in what the operator's CLI shows: bounded in memory and in
//! size however large a dead letter is, and with its control characters
//! escaped.

use crate::common::{self, TestEnv, config, config_text};

/// Puts a letter on the intents' dead-letter queue with `message_id`, `body`
/// and `headers`, as anyone who can publish there could (the topology of
/// `config_text`'s one provider declared first).
async fn plant_letter(env: &TestEnv, message_id: &str, body: &[u8], headers: &[(&str, &str)]) {
    let conn = env.amqp().await;
    onejob::broker::declare_topology(&conn, &["primary".to_owned()], 5)
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
    common::console::dead_letter_with(env, message_id, body, headers).await;
}

/// Runs the CLI with `args` and returns its output and its peak resident set
/// in bytes, as the kernel counted it (read by Python's `resource`, which the
/// machine has; the crate forbids the unsafe a direct getrusage would need).
fn cli_peak_rss(env: &TestEnv, path: &std::path::Path, args: &[&str]) -> (String, u64) {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import resource, subprocess, sys\n\
             r = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE)\n\
             sys.stdout.buffer.write(r.stdout)\n\
             print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n\
             sys.exit(r.returncode)",
            env!("CARGO_BIN_EXE_onejob"),
        ])
        .args(args)
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", path)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "onejob {args:?}: {stderr}");
    let kib: u64 = stderr.trim().lines().last().unwrap().parse().unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        kib * 1024,
    )
}

/// `dlq list` holds one letter at a time: its memory does not grow with the
/// number of letters, and what it shows of each is bounded however large the
/// letter's body or headers are.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn browsing_dead_letters_holds_one_letter_at_a_time() {
    const BIG: usize = 12 << 20;
    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let body = vec![b'x'; BIG];
    let huge_reason = "r".repeat(100 << 10);
    plant_letter(
        &env,
        "big-0",
        &body,
        &[("x-onejob-error", huge_reason.as_str())],
    )
    .await;
    let list = ["dlq", "list", "onejob.intents.dlq"];
    let (shown, one) = cli_peak_rss(&env, &file.path, &list);
    assert!(
        shown.len() < 4096,
        "what one letter shows is bounded: {} bytes",
        shown.len()
    );
    let json = env.cli_ok(&file.path, &["--json", "dlq", "list", "onejob.intents.dlq"]);
    assert!(json.stdout.len() < 4096, "{} bytes", json.stdout.len());

    for i in 1..8 {
        plant_letter(&env, &format!("big-{i}"), &body, &[]).await;
    }
    let (text, eight) = cli_peak_rss(&env, &file.path, &list);
    assert!(text.contains("8 dead letter(s)"), "{text}");
    assert!(
        eight < one + BIG as u64,
        "eight letters of 12 MiB peaked at {} MiB, one at {} MiB",
        eight >> 20,
        one >> 20
    );
}

/// Text from outside reaches the operator's terminal with its control
/// characters escaped, in every command's plain output: a dead letter's id,
/// headers and body, and a job's fields written by another program. `--json`
/// stays exact JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outside_text_reaches_the_terminal_escaped() {
    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let title = "\u{1b}]0;pwned\u{7}";
    let clear = "\u{1b}[2J\u{1b}[H";
    let forged = "ok\r\nonejob: all clear";
    let c1 = "\u{9b}31m";
    plant_letter(
        &env,
        &format!("id{title}"),
        format!("{{\"x\":\"{clear}{c1}\"}}").as_bytes(),
        &[
            ("x-onejob-error", forged),
            ("x-onejob-original-exchange", title),
            ("x-onejob-original-routing-key", clear),
        ],
    )
    .await;
    let raw = ['\u{1b}', '\u{7}', '\r', '\u{9b}'];
    let out = env.cli_ok(&file.path, &["dlq", "list"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.contains(raw), "raw control characters in:\n{text:?}");
    assert!(text.contains("\\u{1b}]0;pwned\\u{7}"), "{text}");
    assert!(
        !text.contains("\nonejob: all clear"),
        "a forged line: {text}"
    );
    let out = env.cli_ok(&file.path, &["--json", "dlq", "list"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["message_id"], format!("id{title}"));
    assert_eq!(listed[0]["reason"], forged);

    // A job as another program may have written it.
    let (job, started) = common::console::unknown_job(&env.store, "k-terminal").await;
    sqlx::query("UPDATE jobs SET error = $2 WHERE id = $1")
        .bind(job.0)
        .bind(format!("{clear}{forged}"))
        .execute(env.store.pool())
        .await
        .unwrap();
    sqlx::query("UPDATE attempts SET error = $2, provider_request_id = $3 WHERE id = $1")
        .bind(started.attempt_id.0)
        .bind(format!("{title}{c1}"))
        .bind(forged)
        .execute(env.store.pool())
        .await
        .unwrap();
    for args in [
        vec!["jobs".to_owned(), "show".to_owned(), job.to_string()],
        vec![
            "jobs".into(),
            "find".into(),
            "--owner".into(),
            "acct_c".into(),
            "--key".into(),
            "k-terminal".into(),
        ],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = env.cli_ok(&file.path, &args);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains("\\u{1b}[2J"), "{args:?}: {text}");
        assert!(
            !text.contains(raw),
            "{args:?}: raw control characters in:\n{text:?}"
        );
        assert!(
            !text.contains("\nonejob: all clear"),
            "{args:?}: a forged line: {text}"
        );
    }
}
