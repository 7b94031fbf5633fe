//! Shared by the database-fault tests: a session that holds a job row, jobs
//! admitted and started, and a database that goes with the test.

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::time::Duration;

use onejob::domain::{AttemptStatus, JobId};
use onejob::edges::store::{Admission, Finished, Started, Store, Verdict};
use serde_json::json;
use sqlx::{Connection, Executor, PgConnection};

use super::{TestEnv, config, config_text, new_job};

/// A session like an operator's `psql` that holds one job row `FOR UPDATE`
/// until it is dropped or [`Holder::release`]d.
pub struct Holder(PgConnection);

impl Holder {
    pub async fn hold(url: &str, job: JobId) -> Holder {
        let mut conn = PgConnection::connect(url).await.expect("holder connects");
        conn.execute("BEGIN").await.expect("begin");
        sqlx::query("SELECT id FROM jobs WHERE id = $1 FOR UPDATE")
            .bind(job.0)
            .fetch_one(&mut conn)
            .await
            .expect("lock the job row");
        Holder(conn)
    }

    /// Holds the job row and its attempts' rows, as a session that settles
    /// or resolves the job by hand would.
    pub async fn hold_with_attempts(url: &str, job: JobId) -> Holder {
        let mut conn = PgConnection::connect(url).await.expect("holder connects");
        conn.execute("BEGIN").await.expect("begin");
        sqlx::query(
            "SELECT j.id FROM jobs j JOIN attempts a ON a.job_id = j.id WHERE j.id = $1 FOR UPDATE",
        )
        .bind(job.0)
        .fetch_all(&mut conn)
        .await
        .expect("lock the job's rows");
        Holder(conn)
    }

    pub async fn release(mut self) {
        self.0.execute("ROLLBACK").await.expect("release");
        self.0.close().await.ok();
    }
}

/// Admits `n` jobs and starts their first attempts.
pub async fn started(store: &Store, prefix: &str, n: usize) -> Vec<Started> {
    let news: Vec<_> = (0..n)
        .map(|i| new_job("acct_db", &format!("{prefix}-{i}"), "text"))
        .collect();
    let attempts: Vec<_> = news.iter().map(|n| n.attempt_id).collect();
    for admitted in store.admission().admit(&news).await.unwrap() {
        assert!(matches!(admitted, Admission::Created { .. }));
    }
    let started = store
        .settle()
        .start("primary", &attempts, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(started.len(), n);
    started
}

pub fn success(s: &Started) -> Finished {
    Finished {
        attempt_id: s.attempt_id,
        job_id: s.job_id,
        version: s.version,
        provider_request_id: Some(format!("req-{}", s.attempt_id)),
        usage: Some(json!({"total_tokens": 10})),
        verdict: Verdict::Succeeded(json!({ "summary": s.attempt_id.to_string() })),
        asked: None,
    }
}

/// `s`'s outcome, with `verdict`, no request id and no usage.
pub fn finished(s: &Started, verdict: Verdict) -> Finished {
    Finished {
        attempt_id: s.attempt_id,
        job_id: s.job_id,
        version: s.version,
        provider_request_id: None,
        usage: None,
        verdict,
        asked: None,
    }
}

pub fn give_up(f: &onejob::policy::next::FailedJob) -> onejob::policy::next::NextStep {
    super::give_up(f)
}

/// Sets a `lock_timeout` of 300 ms on the test's database, as a production
/// role or database often has: sessions opened from now on have it.
pub async fn set_lock_timeout(env: &TestEnv) {
    env.store
        .pool()
        .execute(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} SET lock_timeout = '300ms'",
            env.name
        )))
        .await
        .unwrap();
}

/// `host:port` of the test Postgres, for a proxy in front of it.
pub fn pg_server() -> String {
    super::pg_base()
        .rsplit('@')
        .next()
        .expect("a host in the Postgres URL")
        .to_owned()
}

/// Sets a `lock_timeout` on the test's database ([`set_lock_timeout`]) and
/// connects a store whose sessions have it.
pub async fn with_lock_timeout(env: &TestEnv) -> Store {
    set_lock_timeout(env).await;
    let (config, _file) = config(&config_text("http://127.0.0.1:9/v1", None, ""));
    Store::connect(
        &env.database_url,
        4,
        onejob::shared::runtime::routes(&config),
        Duration::from_secs(5),
    )
    .await
    .unwrap()
}

/// Fails the test, instead of hanging it, when `f` waits for a lock.
pub async fn soon<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} waited for a held row"))
}

pub async fn attempt_status(store: &Store, job: JobId) -> AttemptStatus {
    store.jobs().job(job).await.unwrap().unwrap().attempts[0].status
}

/// Drops a database the test made, however the test ends.
pub struct DropDatabase(pub String);

impl Drop for DropDatabase {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args([
                &format!("{}/postgres", super::pg_base()),
                "-q",
                "-c",
                &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.0),
            ])
            .output();
    }
}

/// From now on `env`'s audit table refuses every row (a trigger raises), to
/// show that an action whose audit row cannot be written is not done.
pub async fn refuse_audit(env: &super::TestEnv) {
    sqlx::raw_sql(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'the audit table refuses rows'; END $$;
         CREATE TRIGGER refuse BEFORE INSERT ON audit FOR EACH ROW EXECUTE FUNCTION refuse();",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
}
