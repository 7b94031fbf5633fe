//! A third party's check of the Anthropic kind: the LiteLLM proxy (from
//! pip, `litellm[proxy]`, which `scripts/litellm` installs) serves an
//! Anthropic-format `POST /v1/messages` in front of an OpenAI-compatible
//! backend, the bundled mock. onejob's `kind = "anthropic"` qualifies
//! through it and runs a job through it, its key checked by the proxy, as
//! the OpenAI kind does against the mock directly; a wrong key is a definite
//! failure.
//!
//! LiteLLM is found at `ONEJOB_LITELLM` (scripts/test sets it; the test
//! fails, never skips, without it). It is started on a free port, with the
//! prices it keeps locally (this machine has no internet) and with
//! `/v1/messages` sent to the backend's `/chat/completions` (by default it
//! sends an OpenAI model's messages to the Responses API, which the mock
//! does not serve). It is stopped by its PID at the end.

use onejob_test_support as common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{P, TestEnv, config, config_for, mock, submit, wait_for, wait_for_status};
use onejob::domain::JobStatus;
use onejob::mock::MockOptions;
use onejob_producer::Producer;

/// The proxy's key: what onejob must send as `x-api-key`.
const KEY: &str = "sk-onejob-litellm-check";
/// The model name the proxy serves.
const MODEL: &str = "claude-via-litellm";

/// A LiteLLM proxy of this test's, stopped when dropped.
struct LiteLlm {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl LiteLlm {
    async fn start(env: &TestEnv, backend: &str) -> LiteLlm {
        let bin = std::env::var("ONEJOB_LITELLM").unwrap_or_else(|_| {
            panic!("ONEJOB_LITELLM is not set: run scripts/litellm, then the tests through scripts/test")
        });
        let dir = std::env::temp_dir().join(format!("onejob-litellm-{}", env.name));
        std::fs::create_dir_all(&dir).unwrap();
        let config = format!(
            "model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: openai/mock-model\n      api_base: {backend}\n      api_key: unused-by-the-mock\ngeneral_settings:\n  master_key: {KEY}\n"
        );
        std::fs::write(dir.join("config.yaml"), config).unwrap();
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let log = std::fs::File::create(dir.join("litellm.log")).unwrap();
        let child = Command::new(&bin)
            .args(["--config", "config.yaml", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .current_dir(&dir)
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .env(
                "LITELLM_USE_CHAT_COMPLETIONS_URL_FOR_ANTHROPIC_MESSAGES",
                "true",
            )
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start LiteLLM at {bin}: {e}"));
        let proxy = LiteLlm { child, port, dir };
        let health = format!("http://127.0.0.1:{port}/health/liveliness");
        let http = reqwest::Client::new();
        wait_for("LiteLLM to answer", Duration::from_secs(120), || async {
            let up = http.get(&health).send().await;
            up.is_ok_and(|r| r.status().is_success()).then_some(())
        })
        .await;
        proxy
    }

    fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }
}

impl Drop for LiteLlm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The environment that holds the providers' keys: the proxy's, and one
/// that is not.
const KEYS: [(&str, &str); 2] = [
    ("ONEJOB_LITELLM_KEY", KEY),
    ("ONEJOB_WRONG_KEY", "sk-wrong"),
];

/// Two Anthropic providers through the proxy: `claude` with its key, and
/// `claude-wrong-key`.
fn through(proxy: &LiteLlm) -> common::tempfile_path::TempConfig {
    let claude = |key_env: &str| {
        format!("kind = \"anthropic\"\napi_key_env = \"{key_env}\"\ntimeout = \"20s\"")
    };
    let url = proxy.base_url();
    let text = config_for(
        &[
            P("claude", &url, &claude("ONEJOB_LITELLM_KEY")),
            P("claude-wrong-key", &url, &claude("ONEJOB_WRONG_KEY")),
        ],
        "",
    )
    .replace("model = \"mock-model\"", &format!("model = \"{MODEL}\""));
    common::tempfile_path::TempConfig::new(&text)
}

/// A onejob program with `config` and the keys in its environment.
fn program(env: &TestEnv, bin: &std::path::Path, config: &std::path::Path) -> Command {
    let mut command = Command::new(bin);
    command
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("ONEJOB_CONFIG", config)
        .env("RUST_LOG", "warn")
        .envs(KEYS);
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_anthropic_kind_works_through_litellms_messages_route() {
    let backend = mock(MockOptions::default()).await;
    let (cfg, _file) = config(&config_for(&[P("primary", &backend.base_url(), "")], ""));
    let env = TestEnv::new(&cfg).await;
    let proxy = LiteLlm::start(&env, &backend.base_url()).await;
    let file = through(&proxy);

    // Qualification: the golden case through the proxy, judged by the contract.
    let cli = std::path::Path::new(env!("CARGO_BIN_EXE_onejob"));
    let qualify = |provider: &str| {
        program(&env, cli, &file.path)
            .args(["providers", "qualify", provider, "--json"])
            .output()
            .unwrap()
    };
    let out = qualify("claude");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    // Any other key is not the proxy's: refused, a definite failure. (Run
    // without a database, LiteLLM answers a key it does not know with 400
    // "No connected db." rather than 401.)
    let wrong = qualify("claude-wrong-key");
    let said = String::from_utf8_lossy(&wrong.stdout).into_owned();
    assert!(
        !wrong.status.success() && said.contains("provider_error: HTTP 4"),
        "{said}"
    );

    // A job through a worker process whose environment holds the key.
    let log = std::fs::File::create(proxy.dir.join("worker.log")).unwrap();
    let mut worker = program(&env, &common::binaries::binary("onejob-worker"), &file.path)
        .stderr(log)
        .spawn()
        .unwrap();
    let producer = Producer::connect(&env.amqp_url).await.unwrap();
    let job_id = submit(&producer, "acct_litellm", "l-1", "through a proxy").await;
    let job = wait_for_status(&env, job_id, JobStatus::Succeeded).await;
    let summary = job.result.unwrap()["summary"].as_str().unwrap().to_owned();
    assert!(summary.contains("through a proxy"), "{summary}");
    let spent: i64 = wait_for(
        "the spend to be counted",
        Duration::from_secs(20),
        || async {
            sqlx::query_scalar(
                "SELECT sum(tokens)::int8 FROM owner_spend WHERE owner_id = 'acct_litellm'",
            )
            .fetch_one(env.store.pool())
            .await
            .unwrap()
        },
    )
    .await;
    assert!(spent > 12, "{spent} tokens: the mock answers with 12");
    producer.close().await;
    let _ = worker.kill();
    let _ = worker.wait();
    drop(proxy);
}
