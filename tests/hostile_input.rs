//! Hostile input from outside: a provider is not trusted with where tenant
//! data goes (its redirects are never followed), and secrets pasted into URLs
//! are never printed.

mod common;

use common::{TestEnv, config, config_text, mock, submit, wait_for_status};
use onejob::domain::JobStatus;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

/// A provider endpoint that answers every call with a redirect to `target`
/// (307 keeps the method and the body: a client that follows it re-POSTs the
/// prompt there).
async fn redirecting_to(target: String) -> String {
    let app = axum::Router::new().fallback(move || {
        let target = target.clone();
        async move {
            (
                axum::http::StatusCode::TEMPORARY_REDIRECT,
                [(axum::http::header::LOCATION, target)],
            )
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/v1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_providers_redirect_is_never_followed() {
    // Where a redirect would take the prompt: a server that records what it got.
    let elsewhere = mock(MockOptions::default()).await;
    let provider = redirecting_to(format!("{}/chat/completions", elsewhere.base_url())).await;
    let (config, _file) = config(&config_text(&provider, None, ""));
    let env = TestEnv::new(&config).await;
    let fleet = env.fleet(config.clone(), vec![]).await;
    let producer = Producer::connect(&env.amqp_url).await.unwrap();

    let job = submit(&producer, "acct_redirect", "k-1", "tenant secret").await;
    let job = wait_for_status(&env, job, JobStatus::Failed).await;
    assert_eq!(
        elsewhere.stats.requests(),
        0,
        "the prompt never went where the redirect pointed"
    );
    for attempt in &job.attempts {
        let error = attempt.error.as_deref().unwrap_or_default();
        assert!(
            error.contains("307"),
            "a redirect is a definite failure: {error}"
        );
    }
    fleet.stop().await;
}

/// A secret in a provider's URL (a key in its query string) or in a
/// connection URL's password pasted with an unencoded `#`, `/` or `?` is never
/// printed, `--json` included.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn secrets_in_urls_are_never_printed() {
    let (config, file) = config(&config_text(
        "http://127.0.0.1:9/v1?api-key=Winter",
        None,
        "",
    ));
    let env = TestEnv::new(&config).await;
    for args in [
        &["providers", "list", "--json"][..],
        &["providers", "list"][..],
    ] {
        let out = env.cli(&file.path, args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("api-key=***") && !text.contains("Winter"),
            "{text}"
        );
    }
    for url in [
        "postgres://svc:2024#Winter@127.0.0.1:1/onejob",
        "postgres://svc:12/Winter@127.0.0.1:1/onejob",
        "postgres://svc:2024?Winter@127.0.0.1:1/onejob",
    ] {
        for json in [false, true] {
            let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_onejob"));
            cmd.args(["jobs", "find", "--owner", "o", "--key", "k"])
                .env("DATABASE_URL", url)
                .env("AMQP_URL", &env.amqp_url)
                .env("ONEJOB_CONFIG", &file.path);
            if json {
                cmd.arg("--json");
            }
            let out = cmd.output().unwrap();
            let all = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!out.status.success());
            assert!(!all.contains("Winter"), "{url}: {all}");
        }
    }
}

/// Every answer of the console, signed in or not, page or error or redirect
/// or stylesheet, forbids framing and caching and allows no inline script or
/// style: what a page shows cannot be framed by another site, left in a
/// shared cache, or turned into script by text that slipped through.
#[tokio::test]
async fn every_console_answer_forbids_framing_caching_and_inline_code() {
    use common::console::{serve, two_providers, unknown_job};
    use reqwest::header::COOKIE;

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve(&env, config, false).await;
    let session = served.sign_in(&env.store, "ada").await;
    let (job, started) = unknown_job(&env.store, "k-frames").await;
    let attempt = started.attempt_id;

    let signed_in = [
        "/".to_owned(),
        "/jobs".to_owned(),
        format!("/jobs/{job}"),
        "/unknowns".to_owned(),
        format!("/attempts/{attempt}/resolve?as=failed"),
        "/dead-letters".to_owned(),
        "/dead-letters/confirm?action=replay&queue=onejob.intents.dlq".to_owned(),
        "/providers".to_owned(),
        "/providers/qualify?provider=primary".to_owned(),
        "/no-such-page".to_owned(),
        "/static/console.css".to_owned(),
    ];
    let mut answers = Vec::new();
    for path in &signed_in {
        let answer = served
            .http
            .get(format!("{}{path}", served.base))
            .header(COOKIE, &session.cookie)
            .send()
            .await
            .unwrap();
        answers.push((format!("GET {path} (signed in)"), answer));
    }
    for path in ["/login", "/", "/jobs"] {
        let answer = served
            .http
            .get(format!("{}{path}", served.base))
            .send()
            .await
            .unwrap();
        answers.push((format!("GET {path} (signed out)"), answer));
    }
    let refused = served
        .post(&session.cookie, "/logout", &[("csrf", "forged")])
        .await;
    answers.push(("POST /logout (forged)".to_owned(), refused));

    for (what, answer) in answers {
        let h = answer.headers().clone();
        let get = |name: &str| {
            h.get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(get("x-frame-options"), "DENY", "{what}");
        let csp = get("content-security-policy");
        for directive in [
            "default-src 'none'",
            "frame-ancestors 'none'",
            "form-action 'self'",
            "base-uri 'none'",
            "style-src 'self'",
        ] {
            assert!(csp.contains(directive), "{what}: {directive} in {csp:?}");
        }
        assert!(!csp.contains("unsafe-inline"), "{what}: {csp}");
        assert!(get("cache-control").contains("no-store"), "{what}");
        assert_eq!(get("x-content-type-options"), "nosniff", "{what}");
        assert_eq!(get("referrer-policy"), "no-referrer", "{what}");
        let body = answer.text().await.unwrap().to_ascii_lowercase();
        assert!(!body.contains("<script"), "{what}: inline script");
        assert!(!body.contains(" style="), "{what}: inline style");
        assert!(!body.contains("<style"), "{what}: inline style");
    }
}

/// The audit rows of `action`, oldest first, as (target, reason, detail).
async fn audit_rows(env: &TestEnv, action: &str) -> Vec<(String, String, serde_json::Value)> {
    sqlx::query_as::<_, (Option<String>, String, serde_json::Value)>(
        "SELECT target, reason, detail FROM audit WHERE action = $1 ORDER BY at, id",
    )
    .bind(action)
    .fetch_all(env.store.pool())
    .await
    .unwrap()
    .into_iter()
    .map(|(t, r, d)| (t.unwrap_or_default(), r, d))
    .collect()
}

/// Granting access, taking it away and spending money from the CLI are
/// operator actions like any other: each is audited, and audited first, so
/// one whose row cannot be written is not done.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_operator_action_from_the_cli_is_audited_first() {
    let provider = mock(MockOptions::default()).await;
    let url = provider.base_url();
    let (config, file) = config(&common::config_for(
        &[
            common::P("primary", &url, ""),
            common::P("fallback", &url, ""),
        ],
        "",
    ));
    let env = TestEnv::new(&config).await;
    let path = &file.path;

    env.cli_ok(
        path,
        &[
            "tokens",
            "create",
            "--owner",
            "acct_a",
            "--reason",
            "onboarding",
        ],
    );
    env.cli_ok(path, &["tokens", "create", "--operator", "ada"]);
    let out = env.cli_ok(path, &["--json", "tokens", "list"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tenant_token = listed[0]["id"].as_str().unwrap().to_owned();
    let created = audit_rows(&env, "token.create").await;
    assert_eq!(created.len(), 2, "{created:?}");
    assert_eq!(created[0].0, "owner:acct_a");
    assert_eq!(created[0].1, "onboarding");
    assert_eq!(created[0].2["token_id"], tenant_token.as_str());
    assert_eq!(created[1].0, "operator:ada");

    env.cli_ok(
        path,
        &[
            "tokens",
            "revoke",
            &tenant_token,
            "--reason",
            "contract ended",
        ],
    );
    let revoked = audit_rows(&env, "token.revoke").await;
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert_eq!(revoked[0].0, "owner:acct_a");
    assert_eq!(revoked[0].1, "contract ended");
    assert_eq!(revoked[0].2["token_id"], tenant_token.as_str());

    let out = env.cli(
        path,
        &["providers", "qualify", "primary", "--reason", "new key"],
    );
    assert!(out.status.code().is_some(), "{out:?}");
    let qualified = audit_rows(&env, "provider.qualify").await;
    assert_eq!(qualified.len(), 1, "{qualified:?}");
    assert_eq!(qualified[0].1, "new key");
    assert!(
        qualified[0].0.starts_with("primary/"),
        "{:?}",
        qualified[0].0
    );
    assert!(
        matches!(qualified[0].2["outcome"].as_str(), Some("done")),
        "{:?}",
        qualified[0].2
    );
    assert!(qualified[0].2["cases"].as_u64().unwrap() > 0);

    // From now on the audit table refuses every row: nothing is done.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'the audit table refuses rows'; END $$;
         CREATE TRIGGER refuse BEFORE INSERT ON audit FOR EACH ROW EXECUTE FUNCTION refuse();",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    let tokens = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT (SELECT count(*) FROM gateway_tokens) + (SELECT count(*) FROM operator_tokens)",
        )
        .fetch_one(env.store.pool())
        .await
        .unwrap()
    };
    let before = tokens().await;
    let out = env.cli(path, &["tokens", "create", "--owner", "acct_b"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "no token is shown");
    assert_eq!(tokens().await, before, "no token was made");
    let operator_token = listed_operator(&env, path);
    let out = env.cli(path, &["tokens", "revoke", &operator_token]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let still: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT revoked_at FROM operator_tokens WHERE id = $1::uuid")
            .bind(&operator_token)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert!(still.is_none(), "the token was not revoked");
    let calls = provider.stats.requests();
    let out = env.cli(path, &["providers", "qualify", "primary"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(provider.stats.requests(), calls, "no paid call was made");
}

fn listed_operator(env: &TestEnv, path: &std::path::Path) -> String {
    let out = env.cli_ok(path, &["--json", "tokens", "list", "--operators"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    listed[0]["id"].as_str().unwrap().to_owned()
}

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

/// The image serves nothing on every interface unless it is told to: its
/// default command binds loopback, and compose names, for each service, the
/// one address it exposes on the compose network.
#[test]
fn the_image_listens_on_loopback_unless_told_otherwise() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    let cmd = dockerfile
        .lines()
        .find(|l| l.starts_with("CMD"))
        .expect("a default command");
    assert!(!cmd.contains("0.0.0.0"), "{cmd}");
    assert!(cmd.contains("127.0.0.1:9090"), "{cmd}");
    let compose = std::fs::read_to_string(root.join("compose.yaml")).unwrap();
    for line in compose.lines().filter(|l| l.contains("0.0.0.0")) {
        assert!(
            line.trim_start().starts_with("command:"),
            "compose binds all interfaces only in a service's own command: {line}"
        );
    }
}

/// Posts a chat completion whose prompt is `prompt` to the mock at `base`,
/// with `key` as its Idempotency-Key.
async fn ask_mock(
    base: &str,
    prompt: &str,
    key: &str,
) -> Result<reqwest::Response, reqwest::Error> {
    reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .header("idempotency-key", key)
        .json(&serde_json::json!({"messages": [{"role": "user", "content": prompt}]}))
        .send()
        .await
}

/// The mock provider's `mock:` directives come from the prompt, which is a
/// tenant's text: it honours them only when started with them allowed, clamps
/// them when it does, and keeps a bounded record of what it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mock_takes_no_orders_from_tenants_by_default() {
    let addr = "127.0.0.1:0".parse().unwrap();
    let plain = onejob::mock::start(addr, MockOptions::default())
        .await
        .unwrap();
    let answer = ask_mock(&plain.base_url(), "hello mock:status=503 mock:prose", "k")
        .await
        .unwrap();
    assert_eq!(
        answer.status(),
        reqwest::StatusCode::OK,
        "a directive was obeyed"
    );
    let text = answer.text().await.unwrap();
    assert!(text.contains("mock answer"), "{text}");

    let steered = onejob::mock::start(
        addr,
        MockOptions {
            directives: true,
            record_limit: 100,
            ..MockOptions::default()
        },
    )
    .await
    .unwrap();
    let answer = ask_mock(&steered.base_url(), "mock:status=503", "k")
        .await
        .unwrap();
    assert_eq!(answer.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    // A pad no machine could hold is clamped, not attempted.
    let answer = ask_mock(&steered.base_url(), "mock:pad=1000000000000000000", "k")
        .await
        .expect("an answer, not a crash");
    assert_eq!(answer.status(), reqwest::StatusCode::OK);
    let size = answer.bytes().await.unwrap().len();
    assert!(size <= onejob::mock::MAX_PAD + 4096, "{size} bytes");
    let answer = ask_mock(&steered.base_url(), "mock:status=99999", "k")
        .await
        .unwrap();
    assert_eq!(
        answer.status(),
        reqwest::StatusCode::OK,
        "no such status: ignored"
    );

    for i in 0..150 {
        ask_mock(&steered.base_url(), "hi", &format!("key-{i}"))
            .await
            .unwrap();
    }
    let keys = steered.stats.idempotency_keys();
    assert_eq!(keys.len(), 100, "the record is bounded");
    assert_eq!(
        keys.last().map(String::as_str),
        Some("key-149"),
        "the latest kept"
    );
}

/// Sign-in is throttled per client: past the allowance, an attempt is
/// refused at once (429, with when to retry) before the database is asked,
/// even with a good token.
#[tokio::test]
async fn sign_in_is_throttled_per_client() {
    use common::console::{serve_with, two_providers};
    use onejob::token::Token;

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve_with(&env, config, |o| o.sign_ins_per_minute = 5).await;
    let good = Token::generate_operator();
    env.store
        .create_operator_token("ada", &good, &onejob::store::Actor::cli(None))
        .await
        .unwrap();
    let wrong = Token::generate_operator();
    for _ in 0..5 {
        let answer = served.login(wrong.reveal()).await;
        assert_eq!(answer.status(), reqwest::StatusCode::UNAUTHORIZED);
    }
    let answer = served.login(good.reveal()).await;
    assert_eq!(answer.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    assert!(answer.headers().contains_key("retry-after"));
    assert!(
        common::console::session_set(&answer).is_none(),
        "not signed in"
    );
    let text = answer.text().await.unwrap();
    assert!(text.contains("Too many sign-in attempts"), "{text}");
}

/// Sessions past their expiry are deleted by a timer, not only when someone
/// next signs in.
#[tokio::test]
async fn expired_sessions_are_swept_on_a_timer() {
    use common::console::{serve_with, two_providers};

    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve_with(&env, config, |o| {
        o.session_ttl = std::time::Duration::from_secs(1);
        o.session_sweep = std::time::Duration::from_millis(200);
    })
    .await;
    served.sign_in(&env.store, "ada").await;
    common::wait_for(
        "the expired session to be deleted",
        std::time::Duration::from_secs(20),
        || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM operator_sessions")
                .fetch_one(env.store.pool())
                .await
                .unwrap();
            (n == 0).then_some(())
        },
    )
    .await;
}

/// A broker that accepts connections and never answers (a network partition,
/// a wedged node) costs the console's overview a short wait, not the page:
/// it shows with the reason, and the dead-letter page says so too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_overview_does_not_wait_out_a_silent_broker() {
    use common::console::{serve_with, two_providers};

    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("amqp://guest:guest@{}/%2f", silent.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((c, _)) = silent.accept().await {
            kept.push(c);
        }
    });
    let (config, _file) = config(&two_providers());
    let env = TestEnv::new(&config).await;
    let served = serve_with(&env, config, |o| o.amqp_url = silent_url).await;
    let session = served.sign_in(&env.store, "ada").await;
    for path in ["/", "/dead-letters"] {
        let (status, page) = tokio::time::timeout(
            std::time::Duration::from_secs(15),
            served.get(&session.cookie, path),
        )
        .await
        .unwrap_or_else(|_| panic!("{path} waited on the broker"));
        assert!(page.contains("did not answer"), "{path}: {status} {page}");
    }
    held.abort();
}

/// A password pasted with an unencoded `#`, `/` or `?` cuts a URL's login
/// short: the rest of it lands in the path, the query or the fragment, where
/// a driver may log it as it parses. The worker and the gateway refuse such a
/// URL at once, saying how to fix it, and print no part of the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_url_whose_login_was_cut_short_is_refused_unprinted() {
    let (config, file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let env = TestEnv::new(&config).await;
    let producer =
        std::path::Path::new(env!("CARGO_BIN_EXE_onejob")).with_file_name("onejob-producer");
    for url in [
        "postgres://svc:2024#Winter@127.0.0.1:1/onejob",
        "postgres://svc:12/Winter@127.0.0.1:1/onejob",
        "postgres://svc:2024?Winter@127.0.0.1:1/onejob",
    ] {
        for (program, args) in [
            (common::chaos::worker_bin(), vec![]),
            (producer.clone(), vec!["serve", "--listen", "127.0.0.1:0"]),
        ] {
            let mut child = std::process::Command::new(&program)
                .args(&args)
                .env("DATABASE_URL", url)
                .env("AMQP_URL", &env.amqp_url)
                .env("ONEJOB_CONFIG", &file.path)
                .env_remove("RUST_LOG")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let exited = common::wait_for(
                "the program to exit",
                std::time::Duration::from_secs(30),
                || {
                    let status = child.try_wait().unwrap();
                    async move { status }
                },
            )
            .await;
            let out = child.wait_with_output().unwrap();
            let all = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!exited.success(), "{program:?} {url}: {all}");
            assert!(!all.contains("Winter"), "{program:?} {url}: {all}");
            assert!(all.contains("percent-encode"), "{program:?} {url}: {all}");
        }
    }
}
