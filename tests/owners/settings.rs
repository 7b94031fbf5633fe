//! `onejob owners`: each owner's own settings over `[owners]`, set with a
//! reason and audited (what they were and became), shown in plain text and
//! JSON, and bad values refused before anything is written.

use serde_json::Value;

use super::config_with_owners;
use crate::common::{TestEnv, config};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_set_changes_one_owners_limits_and_audits_before_and_after() {
    let (config, file) = config(&config_with_owners(
        "http://127.0.0.1:9/v1",
        "max_in_flight = 8\ndaily_tokens = 5000",
    ));
    let env = TestEnv::new(&config).await;
    let cli = |args: &[&str]| env.cli(&file.path, args);
    let json = |out: std::process::Output| -> Value {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };

    // An owner never seen has [owners]'s limits.
    let shown = json(cli(&["owners", "show", "acct_new", "--json"]));
    assert_eq!(shown["limits"]["max_in_flight"], 8);
    assert_eq!(shown["limits"]["daily_tokens"], 5000);
    assert_eq!(shown["own"]["rate"], Value::Null);

    let set = json(cli(&[
        "owners",
        "set",
        "acct_1",
        "--rate",
        "2.5",
        "--max-in-flight",
        "0",
        "--reason",
        "a noisy tenant",
        "--json",
    ]));
    assert_eq!(set["limits"]["rate"], 2.5);
    assert_eq!(
        set["limits"]["max_in_flight"], 0,
        "0 lies over [owners]'s 8: no limit"
    );
    assert_eq!(set["limits"]["daily_tokens"], 5000, "unset: [owners]'s");
    // `default` gives a setting back to [owners].
    json(cli(&[
        "owners",
        "set",
        "acct_1",
        "--max-in-flight",
        "default",
        "--reason",
        "back to normal",
        "--json",
    ]));
    let shown = json(cli(&["owners", "show", "acct_1", "--json"]));
    assert_eq!(shown["limits"]["max_in_flight"], 8);
    assert_eq!(shown["own"]["rate"], 2.5);

    the_two_changes_are_audited(&env).await;

    let listed = json(cli(&["owners", "list", "--json"]));
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["owner_id"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["acct_1"]);
    let plain = cli(&["owners", "list"]);
    let text = String::from_utf8_lossy(&plain.stdout);
    assert!(
        text.contains("acct_1") && text.contains("rate 2.5/s burst 3*"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_owner_settings_are_refused_and_write_nothing() {
    let (config, file) = config(&config_with_owners("http://127.0.0.1:9/v1", ""));
    let env = TestEnv::new(&config).await;
    let cli = |args: &[&str]| env.cli(&file.path, args);
    for (args, code, says) in [
        (
            vec!["owners", "set", "acct_1", "--rate", "NaN", "--reason", "r"],
            2,
            "--rate",
        ),
        (
            vec!["owners", "set", "acct_1", "--rate", "-1", "--reason", "r"],
            2,
            "from 0",
        ),
        (
            vec![
                "owners", "set", "acct_1", "--burst", "2000000", "--reason", "r",
            ],
            2,
            "--burst",
        ),
        (
            vec![
                "owners",
                "set",
                "acct_1",
                "--daily-tokens",
                "lots",
                "--reason",
                "r",
            ],
            2,
            "--daily-tokens",
        ),
        (
            vec!["owners", "set", "acct_1", "--rate", "1"],
            2,
            "--reason",
        ),
        (
            vec!["owners", "set", "acct_1", "--reason", "r"],
            1,
            "nothing to set",
        ),
        (
            vec!["owners", "set", "acct_1", "--rate", "1", "--reason", " "],
            1,
            "--reason",
        ),
        (
            vec!["owners", "set", "bad owner", "--rate", "1", "--reason", "r"],
            1,
            "OWNER",
        ),
    ] {
        let out = cli(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let audit = env.store.audit().recent(10).await.unwrap();
    assert!(audit.is_empty(), "{audit:?}");
    assert!(env.store.owners().list_owners().await.unwrap().is_empty());

    // A bad [owners] stops the program with the setting named.
    let bad =
        crate::common::config_text("http://127.0.0.1:9/v1", None, "") + "\n[owners]\nrate = -2\n";
    let refused = onejob::settings::config::Config::parse(&bad, "t")
        .unwrap_err()
        .to_string();
    assert!(refused.contains("owners.rate"), "{refused}");
}

/// The audit rows of the two changes: who, why, and the settings before and
/// after.
async fn the_two_changes_are_audited(env: &TestEnv) {
    let audit = env.store.audit().recent(10).await.unwrap();
    let rows: Vec<_> = audit.iter().filter(|a| a.action == "owner.set").collect();
    assert_eq!(rows.len(), 2, "{audit:?}");
    let first = rows.iter().find(|a| a.reason == "a noisy tenant").unwrap();
    assert_eq!(first.target.as_deref(), Some("acct_1"));
    assert!(first.actor.starts_with("cli:"), "{}", first.actor);
    assert_eq!(first.detail["before"]["rate"], Value::Null);
    assert_eq!(first.detail["after"]["rate"], 2.5);
    assert_eq!(first.detail["after"]["max_in_flight"], 0);
    let second = rows.iter().find(|a| a.reason == "back to normal").unwrap();
    assert_eq!(second.detail["before"]["max_in_flight"], 0);
    assert_eq!(second.detail["after"]["max_in_flight"], Value::Null);
}
