//! What the run's database says once the worker has gone: its committed
//! transactions, its jobs and attempts, and the backlog's jobs.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::{TestEnv, pg_base};

/// What a database counted: committed transactions, and rows written
/// (inserted, updated or deleted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Counted {
    pub(super) commits: i64,
    pub(super) row_writes: i64,
}

impl std::ops::Sub for Counted {
    type Output = Counted;
    fn sub(self, before: Counted) -> Counted {
        Counted {
            commits: self.commits - before.commits,
            row_writes: self.row_writes - before.row_writes,
        }
    }
}

/// What the database counted, once every backend that had it open has gone
/// (a backend reports its counts when it exits, or up to ten seconds after it
/// goes idle).
pub(super) async fn settled_counts(database: &str) -> Counted {
    let mut admin = PgConnection::connect(&format!("{}/postgres", pg_base()))
        .await
        .expect("connect to read pg_stat_database");
    let began = Instant::now();
    loop {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(database)
        .fetch_one(&mut admin)
        .await
        .expect("read pg_stat_activity");
        if others == 0 {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "{others} connections to {database} stayed open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A backend leaves pg_stat_activity just before it reports its counts.
    let mut last = counted(&mut admin, database).await;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = counted(&mut admin, database).await;
        if now == last {
            admin.close().await.ok();
            return now;
        }
        last = now;
    }
}

async fn counted(admin: &mut PgConnection, database: &str) -> Counted {
    let (commits, row_writes): (i64, i64) = sqlx::query_as(
        "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted \
         FROM pg_stat_database WHERE datname = $1",
    )
    .bind(database)
    .fetch_one(admin)
    .await
    .expect("read pg_stat_database");
    Counted {
        commits,
        row_writes,
    }
}

/// Jobs, succeeded jobs and attempt rows in the run's database.
pub(super) async fn counts(env: &TestEnv) -> (i64, i64, i64) {
    let mut conn = PgConnection::connect(&env.database_url)
        .await
        .expect("connect to count");
    let row: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM jobs), \
                (SELECT count(*) FROM jobs WHERE status = 'succeeded'), \
                (SELECT count(*) FROM attempts)",
    )
    .fetch_one(&mut conn)
    .await
    .expect("count jobs and attempts");
    conn.close().await.ok();
    row
}

/// Jobs whose identity is one of the backlog's keys (`bench`, `d-0` to
/// `d-{n-1}`), each counted once.
pub(super) async fn backlog_jobs(env: &TestEnv, n: usize) -> i64 {
    let mut conn = PgConnection::connect(&env.database_url)
        .await
        .expect("connect to count");
    let keys: Vec<String> = (0..n).map(|i| format!("d-{i}")).collect();
    let found: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT idempotency_key) FROM jobs
         WHERE owner_id = 'bench' AND idempotency_key = ANY($1)",
    )
    .bind(&keys)
    .fetch_one(&mut conn)
    .await
    .expect("count the backlog's jobs");
    conn.close().await.ok();
    found
}

/// Vacuums and analyses the run's database and takes a checkpoint, so that
/// the latency phase that follows the drain does not share the machine with
/// the autovacuum and the checkpoint the drain's dead rows would set off.
pub(super) async fn settle_after_the_drain(database_url: &str) {
    let mut conn = PgConnection::connect(database_url)
        .await
        .expect("connect to vacuum");
    // Apart: VACUUM cannot run in the transaction a multi-statement query is.
    for statement in ["VACUUM (ANALYZE)", "CHECKPOINT"] {
        sqlx::raw_sql(statement)
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{statement} after the drain: {e}"));
    }
    conn.close().await.ok();
}

/// `url` with TLS off. On loopback TLS protects nothing, and this way every
/// program the benchmark compares talks to Postgres alike: libpq (pgbench)
/// and sqlx (onejob) use TLS whenever the server offers it, node-postgres
/// (graphile-worker) only when told to.
pub fn plaintext(url: &str) -> String {
    let join = if url.contains('?') { '&' } else { '?' };
    format!("{url}{join}sslmode=disable")
}
