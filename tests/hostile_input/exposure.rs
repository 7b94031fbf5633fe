//! What is never exposed: secrets pasted into URLs are never printed, and the
//! image listens on loopback unless it is told otherwise.

use crate::common::{self, TestEnv, config, config_text};

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
