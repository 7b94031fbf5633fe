//! What `/metrics` says of the primary's replication, read through HAProxy
//! as onejob reads it, while the cluster changes under it.

use std::time::Duration;

use onejob_test_support::pg_ha::{OwnHa, installed};
use onejob_test_support::{Servers, TestEnv, config, config_text};

/// The gauges as a worker would serve them, read now.
async fn gauges(env: &TestEnv) -> (Option<f64>, Option<f64>) {
    let text = env.store.jobs().gauges().await.unwrap_or_default();
    let sample = |series: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    };
    (
        sample("onejob_database_commits_wait_for_standby"),
        sample("onejob_database_standbys"),
    )
}

/// Waits until the gauges read `want`; says what they last read if they
/// do not within `seconds`.
async fn until(env: &TestEnv, what: &str, want: (f64, f64), seconds: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(seconds);
    loop {
        let now = gauges(env).await;
        if now == (Some(want.0), Some(want.1)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {seconds} s waiting for {what}: the gauges read {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn env_on(ha: &OwnHa) -> TestEnv {
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    let servers = Servers {
        postgres: ha.base_url(),
        rabbit: None,
    };
    TestEnv::on(&config, servers).await
}

/// Synchronous replication: a commit waits for the one standby. When the
/// standby's machine crashes, Patroni (not in strict mode) stops naming a
/// synchronous standby so that writes go on, and the gauges say that
/// commits no longer wait; when it is back, they wait again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gauges_say_whether_commits_wait_for_a_standby_as_the_standby_comes_and_goes() {
    if !installed("the_gauges_say_whether_commits_wait_for_a_standby_as_the_standby_comes_and_goes")
    {
        return;
    }
    let ha = OwnHa::start(true);
    let env = env_on(&ha).await;
    assert_eq!(gauges(&env).await, (Some(1.0), Some(1.0)));
    let standby = 3 - ha.primary();
    ha.script(&["crash", &standby.to_string()]);
    until(
        &env,
        "the commits to stop waiting for the crashed standby",
        (0.0, 0.0),
        60,
    )
    .await;
    ha.script(&["restart", &standby.to_string()]);
    until(
        &env,
        "the commits to wait for the standby again",
        (1.0, 1.0),
        90,
    )
    .await;
}

/// Asynchronous replication: a standby streams, and no commit waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gauges_say_commits_do_not_wait_under_asynchronous_replication() {
    if !installed("the_gauges_say_commits_do_not_wait_under_asynchronous_replication") {
        return;
    }
    let ha = OwnHa::start(false);
    let env = env_on(&ha).await;
    assert_eq!(gauges(&env).await, (Some(0.0), Some(1.0)));
}
