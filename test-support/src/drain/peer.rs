//! graphile-worker, the peer measured in the same run: a Postgres-only job
//! queue whose jobs make the same instant provider call and keep the answer in
//! a table (`peer/graphile.mjs`, tuned as its performance page advises). Its
//! drain runs as onejob's does (a preloaded backlog, the clock from the
//! worker's start to the last result), and its latency from each job's due
//! time to its result's insert, at the same offered loads as onejob's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::{Connection, Executor, PgConnection, PgPool};

use super::database::{Counted, plaintext, settle_after_the_drain, settled_counts};
use super::worker::Usage;
use super::{CpuClock, CpuPerJob, Options, Percentiles, bar, say};
use crate::{TestEnv, pg_base};

/// What the peer did, in the same units as onejob's figures.
#[derive(Clone, Debug, Serialize)]
pub struct PeerFigures {
    pub drain_jobs_per_s: f64,
    pub drain_seconds: f64,
    pub cpu_ms_per_job: f64,
    /// The machine's CPU per job while it drained, by program.
    pub cpu: CpuPerJob,
    pub peak_rss_mib: f64,
    pub commits_per_job: f64,
    pub row_writes_per_job: f64,
    /// Due time → result, at each offered load (jobs per second).
    pub latency: Vec<(f64, Percentiles)>,
    /// Due time → `add_job` returned, at each load: the generator's own share.
    pub add_lag: Vec<Percentiles>,
}

/// The peer's folder, with its package and lock file.
fn folder() -> PathBuf {
    crate::binaries::workspace().join("benches/drain/peer")
}

/// Installs graphile-worker from the lock file, when it is not there yet.
fn install() {
    let dir = folder();
    if dir.join("node_modules/graphile-worker").exists() {
        return;
    }
    say("installing the graphile-worker peer (npm ci)");
    let status = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund", "--loglevel", "error"])
        .current_dir(&dir)
        .status()
        .expect("npm (with Node.js) must be on PATH for the graphile-worker peer");
    assert!(status.success(), "npm ci in {} failed", dir.display());
}

/// The peer's scratch database, with its schema and the results table.
struct PeerDatabase {
    name: String,
    url: String,
}

impl PeerDatabase {
    async fn create(env: &TestEnv) -> PeerDatabase {
        let name = format!("{}_peer", env.name);
        let mut admin = admin().await;
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .expect("create the peer's database");
        admin.close().await.ok();
        let db = PeerDatabase {
            url: format!("{}/{name}", pg_base()),
            name,
        };
        let mut conn = db.connect().await;
        // `n` counts the results as they come (a sequence moves outside
        // transactions), so the drain's watcher reads one value, not the table.
        conn.execute(
            "CREATE TABLE peer_results (key text PRIMARY KEY, result jsonb NOT NULL, \
             finished_at timestamptz NOT NULL DEFAULT clock_timestamp(), n bigserial)",
        )
        .await
        .expect("create peer_results");
        conn.close().await.ok();
        db
    }

    async fn connect(&self) -> PgConnection {
        PgConnection::connect(&plaintext(&self.url))
            .await
            .expect("connect to the peer's database")
    }

    async fn results(&self, conn: &mut PgConnection, prefix: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM peer_results WHERE key LIKE $1 || '%'")
            .bind(prefix)
            .fetch_one(conn)
            .await
            .expect("count the peer's results")
    }

    async fn drop(self) {
        let mut admin = admin().await;
        admin
            .execute(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE {} WITH (FORCE)",
                self.name
            )))
            .await
            .expect("drop the peer's database");
        admin.close().await.ok();
    }
}

async fn admin() -> PgConnection {
    PgConnection::connect(&format!("{}/postgres", pg_base()))
        .await
        .expect("connect as the admin")
}

/// `node graphile.mjs MODE` on the peer's database, its output in `log`.
fn node(mode: &str, db: &PeerDatabase, provider: &str, log: &Path) -> Child {
    let log = std::fs::File::create(log).expect("create the peer's log");
    Command::new("node")
        .arg(folder().join("graphile.mjs"))
        .arg(mode)
        .env("DATABASE_URL", plaintext(&db.url))
        .env("PROVIDER_URL", provider)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log handle"))
        .stderr(log)
        .spawn()
        .expect("node must be on PATH for the graphile-worker peer")
}

/// SIGTERM (graphile-worker releases its jobs and exits), then a kill after 30 s.
async fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let began = Instant::now();
    while matches!(child.try_wait(), Ok(None)) {
        if began.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = child.wait();
}

/// Runs the peer: its drain of `options.n` jobs, then its latency at each of
/// `loads` (jobs per second) for `options.latency_seconds`.
pub(super) async fn graphile(
    env: &TestEnv,
    provider: &str,
    options: &Options,
    loads: &[f64],
) -> PeerFigures {
    install();
    let db = PeerDatabase::create(env).await;
    let migrated = node(
        "migrate",
        &db,
        provider,
        &options.out.join("peer-migrate.log"),
    )
    .wait()
    .expect("node graphile.mjs migrate");
    assert!(migrated.success(), "the peer's migration failed");
    let mut conn = db.connect().await;
    sqlx::query(
        "SELECT graphile_worker.add_job('call', json_build_object('key', 'd-' || i, 'text', 'x')) \
         FROM generate_series(1, $1) i",
    )
    .bind(options.n as i64)
    .execute(&mut conn)
    .await
    .expect("preload the peer's backlog");
    conn.close().await.ok();
    let (seconds, usage, counted, cpu) = drain(&db, provider, options).await;
    let n = options.n as f64;
    say(&format!(
        "graphile-worker drained {} jobs in {seconds:.1} s: {:.0} jobs/s",
        options.n,
        n / seconds
    ));
    let (mut latency, mut add_lag) = (Vec::new(), Vec::new());
    // As for onejob: no autovacuum of the drain's dead rows during the phase.
    settle_after_the_drain(&db.url).await;
    let worker = node("work", &db, provider, &options.out.join("peer-latency.log"));
    wait_ready(&options.out.join("peer-latency.log")).await;
    let pool = PgPool::connect(&plaintext(&db.url))
        .await
        .expect("the generator's pool");
    for (i, &rate) in loads.iter().enumerate() {
        say(&format!(
            "graphile-worker latency: {rate:.0} jobs/s for {} s, open loop",
            options.latency_seconds
        ));
        let prefix = format!("l{i}-");
        let (measured, lag) = open_loop(&pool, rate, options.latency_seconds, &prefix).await;
        latency.push((rate, measured));
        add_lag.push(lag);
    }
    pool.close().await;
    stop(worker).await;
    db.drop().await;
    PeerFigures {
        drain_jobs_per_s: n / seconds,
        drain_seconds: seconds,
        cpu_ms_per_job: usage.cpu_seconds * 1000.0 / n,
        cpu,
        peak_rss_mib: usage.peak_rss_kib as f64 / 1024.0,
        commits_per_job: counted.commits as f64 / n,
        add_lag,
        row_writes_per_job: counted.row_writes as f64 / n,
        latency,
    }
}

/// The peer's drain: the clock from the worker's start to its last result;
/// what the node process used, the database's commits meanwhile, and the
/// machine's CPU by program.
async fn drain(
    db: &PeerDatabase,
    provider: &str,
    options: &Options,
) -> (f64, Usage, Counted, CpuPerJob) {
    let before = settled_counts(&db.name).await;
    let cpu_before = CpuClock::now();
    let started = Instant::now();
    let worker = node("work", db, provider, &options.out.join("peer-drain.log"));
    let progress = bar(options.n as u64, "graphile-worker draining");
    let mut conn = db.connect().await;
    let limit = Duration::from_secs(120 + options.n as u64 / 20);
    loop {
        let done = results_so_far(&mut conn).await;
        progress.set_position(done as u64);
        if done >= options.n as i64 && db.results(&mut conn, "d-").await >= options.n as i64 {
            break;
        }
        assert!(
            started.elapsed() < limit,
            "the peer did not drain within {limit:?}: {done} of {}",
            options.n
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = CpuClock::now().since(&cpu_before, options.n);
    progress.finish_and_clear();
    let usage = Usage::of(worker.id());
    conn.close().await.ok();
    stop(worker).await;
    // The watcher's reads of the sequence are in the count: one short
    // transaction each 50 ms.
    let counted = settled_counts(&db.name).await - before;
    (seconds, usage, counted, cpu)
}

/// Waits until graphile-worker says it is looking for jobs.
async fn wait_ready(log: &Path) {
    let began = Instant::now();
    while !std::fs::read_to_string(log)
        .unwrap_or_default()
        .contains("looking for jobs")
    {
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "graphile-worker was not ready within a minute; see {}",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many results have come so far: the sequence's last value, which costs
/// the database nothing to read (at most the count of results, as a result
/// retried after a conflict would take a second number).
async fn results_so_far<'e>(db: impl sqlx::PgExecutor<'e>) -> i64 {
    sqlx::query_scalar(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM peer_results_n_seq",
    )
    .fetch_one(db)
    .await
    .expect("read the peer's result count")
}

/// Adds jobs at `rate` per second on a fixed schedule, each with its own
/// `add_job` call from a pool. Returns each job's latency from its due time
/// to its result's insert (`clock_timestamp()` on the machine's one clock;
/// the insert commits on its own, at once), and how late after its due time
/// each `add_job` returned (the generator's own share).
async fn open_loop(
    pool: &PgPool,
    rate: f64,
    seconds: u64,
    prefix: &str,
) -> (Percentiles, Percentiles) {
    let count = ((rate * seconds as f64) as usize).max(1);
    let before = results_so_far(pool).await;
    let lead = Duration::from_millis(100);
    let start = tokio::time::Instant::now() + lead;
    let wall = std::time::SystemTime::now() + lead;
    let offset = move |i: usize| Duration::from_secs_f64(i as f64 / rate);
    let mut adds = tokio::task::JoinSet::new();
    for i in 0..count {
        let due = start + offset(i);
        tokio::time::sleep_until(due).await;
        let pool = pool.clone();
        let key = format!("{prefix}{i}");
        adds.spawn(async move {
            sqlx::query("SELECT graphile_worker.add_job('call', json_build_object('key', $1::text, 'text', 'x'))")
                .bind(key)
                .execute(&pool)
                .await
                .expect("add a peer job");
            tokio::time::Instant::now().saturating_duration_since(due)
        });
    }
    let mut lags = Vec::with_capacity(count);
    while let Some(lag) = adds.join_next().await {
        lags.push(lag.expect("an add_job"));
    }
    // Watch the sequence, not the table, until every result is in.
    let expected = before + count as i64;
    crate::wait_for(
        "every peer result",
        Duration::from_secs(seconds * 3 + 60),
        || async { (results_so_far(pool).await >= expected).then_some(()) },
    )
    .await;
    let rows: Vec<(String, f64)> = sqlx::query_as(
        "SELECT key, extract(epoch FROM finished_at)::float8 FROM peer_results WHERE key LIKE $1 || '%'",
    )
    .bind(prefix)
    .fetch_all(pool)
    .await
    .expect("read the peer's results");
    assert_eq!(rows.len(), count, "a result for every job added");
    let epoch = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let times = rows
        .iter()
        .filter_map(|(key, at)| {
            let i: usize = key.strip_prefix(prefix)?.parse().ok()?;
            let due = epoch(wall + offset(i));
            Some(Duration::from_secs_f64((at - due).max(0.0)))
        })
        .collect();
    (Percentiles::of(times), Percentiles::of(lags))
}
