//! B_pg1: pgbench running onejob's own per-job SQL on onejob's tables, in a
//! scratch database of its own.

use std::process::Command;
use std::time::Duration;

use sqlx::{Connection, Executor, PgConnection};

use super::Options;
use crate::{TestEnv, pg_base};

/// onejob's per-job SQL, one statement a transaction: admission (job and first
/// attempt, as `store.admit` writes them), `queued → started` with the job
/// `running`, and the compare-and-swap that ends the job and its attempt.
const PGBENCH_JOB: &str = r#"WITH job AS (
  INSERT INTO jobs (id, owner_id, idempotency_key, request_fingerprint, operation, input)
  VALUES (gen_random_uuid(), 'pgbench', gen_random_uuid()::text, 'fingerprint', 'summarize', '{"text": "x"}')
  ON CONFLICT (owner_id, idempotency_key) DO NOTHING
  RETURNING id
)
INSERT INTO attempts (id, job_id, number, provider)
SELECT gen_random_uuid(), id, 1, 'primary' FROM job
RETURNING job_id AS job, id AS attempt
\gset
WITH started AS (
  UPDATE attempts SET status = 'started', started_at = now(), deadline_at = now() + interval '30 seconds'
  WHERE id = :attempt AND status = 'queued'
  RETURNING job_id
)
UPDATE jobs SET status = 'running', updated_at = now() FROM started WHERE jobs.id = started.job_id;
WITH won AS (
  UPDATE jobs SET status = 'succeeded', result = '{"summary": "x"}', completed_by = :attempt,
                  version = version + 1, updated_at = now()
  WHERE id = :job AND version = 0 AND completed_by IS NULL
  RETURNING id
)
UPDATE attempts SET status = 'succeeded', finished_at = now() FROM won WHERE attempts.id = :attempt;
"#;

/// B_pg1, in jobs per second.
pub(super) async fn pgbench(
    env: &TestEnv,
    config: &onejob::settings::config::Config,
    options: &Options,
) -> f64 {
    super::say(&format!(
        "B_pg1: pgbench, onejob's per-job SQL, {} s",
        options.pgbench_seconds
    ));
    let name = format!("{}_pgbench", env.name);
    let mut admin = PgConnection::connect(&format!("{}/postgres", pg_base()))
        .await
        .expect("connect to create the pgbench database");
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .expect("create the pgbench database");
    let url = format!("{}/{name}", pg_base());
    let store = onejob::edges::store::Store::connect(
        &url,
        1,
        onejob::shared::runtime::routes(config),
        Duration::from_secs(10),
    )
    .await
    .expect("connect the pgbench database");
    store.migrate().await.expect("migrate the pgbench database");
    store.close().await;
    let script = options.out.join("pgbench-job.sql");
    std::fs::write(&script, PGBENCH_JOB).expect("write the pgbench script");
    let out = Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-c", "4", "-j", "2", "-T"])
        .arg(options.pgbench_seconds.to_string())
        .arg("-f")
        .arg(&script)
        .arg(super::database::plaintext(&url))
        .output()
        .expect("pgbench must be on PATH (the postgresql-contrib or postgresql client package)");
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {name} WITH (FORCE)"
        )))
        .await
        .expect("drop the pgbench database");
    admin.close().await.ok();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "pgbench failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let failed = stdout
        .lines()
        .find_map(|l| l.strip_prefix("number of failed transactions: "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok());
    assert_eq!(failed, Some(0), "pgbench had failures: {stdout}");
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no tps in pgbench's output: {stdout}"))
}
