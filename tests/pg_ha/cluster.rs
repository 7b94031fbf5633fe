//! The cluster's own promise, before onejob is put through it.

use onejob_test_support::pg_ha::{OwnHa, ended, installed};
use sqlx::{Connection, Executor, PgConnection};

/// With synchronous replication, every row whose commit returned through
/// HAProxy is on the standby that takes over when the primary's machine
/// crashes (Patroni and PostgreSQL killed at once): HAProxy routes to the
/// new primary by itself; the crashed node comes back as a standby of it;
/// and a stop leaves none of the cluster's processes running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_primary_fails_over_with_every_committed_row() {
    if !installed("a_crashed_primary_fails_over_with_every_committed_row") {
        return;
    }
    let ha = OwnHa::start(true);
    let url = format!("{}/postgres", ha.base_url());
    let mut db = PgConnection::connect(&url)
        .await
        .expect("connect through HAProxy");
    db.execute("CREATE TABLE committed (n int PRIMARY KEY)")
        .await
        .unwrap();
    for n in 0..200 {
        sqlx::query("INSERT INTO committed VALUES ($1)")
            .bind(n)
            .execute(&mut db)
            .await
            .expect("a commit through HAProxy");
    }
    let old = ha.primary();
    crash(&ha, old);
    // The connection to the crashed node is gone, and says so.
    let cut = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM committed")
        .fetch_one(&mut db)
        .await;
    assert!(cut.is_err(), "a connection to the crashed primary answered");
    let new = ha.wait_primary(old);
    assert_ne!(new, old);
    let mut db = PgConnection::connect(&url)
        .await
        .expect("reconnect through HAProxy");
    let (rows, in_recovery): (i64, bool) =
        sqlx::query_as("SELECT (SELECT count(*) FROM committed), pg_is_in_recovery()")
            .fetch_one(&mut db)
            .await
            .unwrap();
    assert_eq!(rows, 200, "a committed row was lost in the failover");
    assert!(!in_recovery, "HAProxy routed to a standby");

    // The crashed node comes back as the new primary's standby.
    ha.script(&["restart", &old.to_string()]);
    let began = std::time::Instant::now();
    loop {
        let streaming: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
        )
        .fetch_one(&mut db)
        .await
        .unwrap();
        if streaming == 1 {
            break;
        }
        assert!(
            began.elapsed() < std::time::Duration::from_secs(60),
            "the crashed node did not come back as a standby"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert_eq!(ha.primary(), new, "the node that came back took over again");
    db.close().await.ok();

    let pids = ha.pids();
    assert_eq!(
        pids.len(),
        6,
        "etcd, HAProxy, two Patronis, two PostgreSQLs"
    );
    let dir = ha.dir().to_owned();
    drop(ha);
    let alive: Vec<u32> = pids
        .into_iter()
        .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
        .collect();
    assert!(
        alive.is_empty(),
        "processes left running after stop: {alive:?}"
    );
    assert!(!dir.exists(), "its directory was left behind");
}

/// Crashes node `n`'s machine. A machine's crash leaves nothing of its
/// PostgreSQL running: not even a backend that has yet to notice its
/// postmaster is gone.
fn crash(ha: &OwnHa, n: u8) {
    let before = ha.postgres_processes(n);
    assert!(
        before.len() > 1,
        "a postmaster with its backends: {before:?}"
    );
    ha.script(&["crash", &n.to_string()]);
    let left: Vec<u32> = before.iter().copied().filter(|&pid| !ended(pid)).collect();
    assert!(left.is_empty(), "the crash left {left:?} of {before:?}");
}
