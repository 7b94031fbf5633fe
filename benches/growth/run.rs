//! One run of the growth benchmark, shared by `cargo bench --bench growth` and
//! the smoke test that keeps it from rotting (`tests/growth_smoke.rs`).
//!
//! In one run, on this machine's PostgreSQL and RabbitMQ, with one
//! `onejob-worker` process (every role) and the instant mock provider:
//!
//! 1. **Floor**: a little intake, and the rows that must outlive every prune:
//!    succeeded jobs just inside their 7-day window, failed ones inside their
//!    30 days, `unknown` jobs 90 days old, and old succeeded jobs whose event is
//!    still unpublished. The tables' sizes now are the floor.
//! 2. **Fill**: N ended jobs (80% succeeded, 15% failed, 5% cancelled; a failed
//!    one has three attempts) that ended 31 to 61 days ago, in one statement.
//! 3. **Baseline**: while a worker with a ten-year retention runs (it prunes
//!    nothing), intents arrive on a fixed schedule (open loop) and each job's
//!    latency runs from its intent's due time to its `job.succeeded` event.
//! 4. **Pruning**: a worker with the default retention (`[retention]` unset)
//!    takes over and prunes the N jobs while the same intake runs, in windows of
//!    a few seconds, until its `onejob_pruned_total` says all N are gone. Then
//!    the run waits until no table is left with more dead rows than
//!    autovacuum's threshold (the server's autovacuum, or, where it is off, the
//!    pruner's own vacuum).
//! 5. **Refills**: N more, pruned the same way, without intake, twice (by
//!    default): the space the N before left must be reused, not added to. The
//!    first refill grows the indexes by the pages the last vacuum emptied but
//!    could not yet hand out (a B-tree page is reusable only once no
//!    transaction can still see it: at the next vacuum); from the second on,
//!    a fill fits in what the one before it left.
//! 6. **VACUUM FULL**, with the worker stopped: what returning the space to the
//!    operating system costs. Then the intake's own jobs (those that arrived
//!    after the floor) are deleted and the tables are compacted again: they
//!    must be back to their floor.
//!
//! Then it checks that every row of step 1, the intake's jobs and their attempts
//! are exactly as they were, and that nothing of the N is left.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use onejob::mock::MockOptions;
use onejob_producer::Producer;
use serde::Serialize;
use sqlx::{Connection, PgConnection};

use crate::common::{TestEnv, config, fill_jobs, mock};
use crate::drain::{Events, Percentiles, Worker, free_port, machine, open_loop, say};

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Ended jobs in each fill.
    pub n: usize,
    /// Intents per second during the baseline and the pruning.
    pub rate: f64,
    /// Length of the baseline.
    pub baseline_seconds: u64,
    /// Length of each window of the pruning phase's intake.
    pub window_seconds: u64,
    /// Fills after the first, each pruned before the next.
    pub refills: usize,
    /// Where the report goes.
    pub out: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            n: 1_000_000,
            rate: 200.0,
            baseline_seconds: 60,
            window_seconds: 10,
            refills: 2,
            out: PathBuf::from("target/bench"),
        }
    }
}

impl Options {
    /// A run of a minute or so: everything measured, nothing worth quoting.
    pub fn smoke() -> Self {
        Self {
            n: 3000,
            rate: 20.0,
            baseline_seconds: 2,
            window_seconds: 2,
            ..Self::default()
        }
    }
}

/// Rows that must survive every prune, by kind: (key prefix, status, count,
/// age in seconds).
const KEPT: [(&str, &str, i64, f64); 4] = [
    // Just inside the 7 days succeeded jobs are kept by default.
    ("keep-inside-", "succeeded", 1000, 7.0 * 86400.0 - 3600.0),
    // Inside the 30 days for failed ones.
    ("keep-failed-", "failed", 1000, 29.0 * 86400.0),
    // Never pruned, however old.
    ("keep-unknown-", "unknown", 1000, 90.0 * 86400.0),
    // Old enough, but their event is unpublished (below).
    ("keep-unpublished-", "succeeded", 100, 60.0 * 86400.0),
];

/// One table's size, in bytes.
#[derive(Clone, Debug, Serialize)]
pub struct Size {
    pub table: String,
    pub heap: i64,
    pub indexes: i64,
    /// `pg_total_relation_size`: heap, indexes and TOAST.
    pub total: i64,
}

/// The three tables' sizes at a point of the run.
#[derive(Clone, Debug, Serialize)]
pub struct Sizes {
    pub at: String,
    pub tables: Vec<Size>,
}

impl Sizes {
    /// jobs + attempts + outbox, everything counted.
    pub fn total(&self) -> i64 {
        self.tables.iter().map(|t| t.total).sum()
    }
}

/// The intake's latency in one window of the pruning phase.
#[derive(Clone, Debug, Serialize)]
pub struct Window {
    /// Seconds since the pruning worker was ready, at the window's end.
    pub end_s: f64,
    pub latency: Percentiles,
    /// Jobs pruned so far.
    pub pruned: u64,
}

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub machine: String,
    /// The server's `autovacuum` setting.
    pub autovacuum: bool,
    pub n: usize,
    /// The first fill's jobs and their attempts, read back from the tables.
    pub jobs_per_fill: i64,
    pub attempts_per_fill: i64,
    /// The fills made (the first and the refills).
    pub fills: usize,
    /// `onejob_pruned_total` of the pruning worker at the end, by table.
    pub pruned_jobs: u64,
    pub pruned_attempts: u64,
    pub kept: i64,
    pub rate: f64,
    pub fill_seconds: f64,
    /// Each refill's statement.
    pub refill_seconds: Vec<f64>,
    pub baseline: Percentiles,
    pub pruning: Percentiles,
    pub windows: Vec<Window>,
    /// From the pruning worker's readiness to its count reaching N.
    pub prune_seconds: f64,
    /// From each refill to its last job pruned.
    pub refill_prune_seconds: Vec<f64>,
    /// From the last job pruned to no table past autovacuum's threshold.
    pub vacuum_wait_seconds: f64,
    /// `onejob_vacuums_total` of the pruning worker, by table.
    pub worker_vacuums: Vec<(String, f64)>,
    pub vacuum_full_seconds: f64,
    pub sizes: Vec<Sizes>,
    /// Rows of the fills left behind (must be 0).
    pub fill_left: i64,
    /// The kept rows and the intake's jobs before the pruning, with their
    /// attempts, equal to the same rows after both prunes.
    pub kept_unchanged: bool,
    /// Intake jobs published during the pruning phase, and those found after.
    pub intake_published: usize,
    pub intake_found: i64,
}

impl Report {
    fn size(&self, at: &str) -> i64 {
        self.sizes
            .iter()
            .find(|s| s.at == at)
            .map_or(0, Sizes::total)
    }

    /// p99 while pruning over the baseline's p99.
    pub fn p99_ratio(&self) -> f64 {
        self.pruning.p99_ms / self.baseline.p99_ms
    }

    /// What refill `k` (from 1) added to the pruned and vacuumed tables
    /// before it, as a share of what the first fill added to the floor: 0 when
    /// it fit wholly in the space the fill before it left, 1 when it took as
    /// much again.
    pub fn refill_growth(&self, k: usize) -> f64 {
        let before = if k == 1 {
            PRUNED.to_owned()
        } else {
            repruned(k - 1)
        };
        (self.size(&refilled(k)) - self.size(&before)) as f64
            / (self.size(FILLED) - self.size(FLOOR)) as f64
    }

    /// The last refill's growth: what a fill costs once pruning has run a
    /// while.
    pub fn steady_growth(&self) -> f64 {
        self.refill_growth(self.refill_seconds.len())
    }

    /// The tables compacted with only the floor's rows left, over the floor.
    pub fn back_to_floor(&self) -> f64 {
        self.size(BACK) as f64 / self.size(FLOOR) as f64
    }

    /// The report as markdown.
    pub fn markdown(&self) -> String {
        let mib = |b: i64| format!("{:.1}", b as f64 / (1024.0 * 1024.0));
        let ms = |p: &Percentiles| format!("{:.1} / {:.1} / {:.1}", p.p50_ms, p.p99_ms, p.p999_ms);
        let yes = |b: bool| if b { "yes" } else { "**no**" };
        let mut md = format!(
            "growth benchmark on {}\n\n\
             {} ended jobs ({} attempts) filled {} times beside {} kept rows; intake {:.0} intents/s; \
             autovacuum {}\n\n\
             | measure | value | target | met |\n|---|---|---|---|\n\
             | intake p99 while pruning / baseline p99, same run | {:.2} ({:.1} / {:.1} ms) | ≤ 2 | {} |\n\
             | growth of the last refill / the first fill's growth (each refill: {}) | {:.3} | ≤ 0.10 | {} |\n\
             | compacted with the floor's rows alone / floor | {:.3} | ≤ 1.10 | {} |\n\
             | kept rows and intake jobs unchanged | {} | yes | {} |\n\
             | rows of the fills left | {} | 0 | {} |\n\
             | intake jobs found / published while pruning | {} / {} | all | {} |\n",
            self.machine,
            self.n,
            self.attempts_per_fill,
            self.refill_seconds.len() + 1,
            self.kept,
            self.rate,
            if self.autovacuum {
                "on"
            } else {
                "off (onejob's pruner vacuums)"
            },
            self.p99_ratio(),
            self.pruning.p99_ms,
            self.baseline.p99_ms,
            yes(self.p99_ratio() <= 2.0),
            (1..=self.refill_seconds.len())
                .map(|k| format!("{:.3}", self.refill_growth(k)))
                .collect::<Vec<_>>()
                .join(", "),
            self.steady_growth(),
            yes(self.steady_growth() <= 0.10),
            self.back_to_floor(),
            yes(self.back_to_floor() <= 1.10),
            self.kept_unchanged,
            yes(self.kept_unchanged),
            self.fill_left,
            yes(self.fill_left == 0),
            self.intake_found,
            self.intake_published,
            yes(self.intake_found == self.intake_published as i64),
        );
        md.push_str(&format!(
            "\n| figure | value |\n|---|---|\n\
             | fill: {} jobs, one statement | {:.1} s |\n\
             | each refill | {} s |\n\
             | prune {} jobs while intake runs (worker ready → all gone) | {:.1} s ({:.0} jobs/s) |\n\
             | prune each refill, no intake | {} s |\n\
             | last prune → no table past autovacuum's threshold | {:.1} s |\n\
             | vacuums by the pruning worker | {} |\n\
             | VACUUM FULL jobs, attempts, outbox (worker stopped) | {:.1} s |\n\
             | intake latency p50 / p99 / p99.9, baseline | {} ms ({} jobs) |\n\
             | intake latency p50 / p99 / p99.9, while pruning | {} ms ({} jobs) |\n",
            self.n,
            self.fill_seconds,
            seconds(&self.refill_seconds),
            self.n,
            self.prune_seconds,
            self.n as f64 / self.prune_seconds,
            seconds(&self.refill_prune_seconds),
            self.vacuum_wait_seconds,
            self.worker_vacuums
                .iter()
                .map(|(t, n)| format!("{t} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.vacuum_full_seconds,
            ms(&self.baseline),
            self.baseline.samples,
            ms(&self.pruning),
            self.pruning.samples,
        ));
        md.push_str("\n| tables (MiB) | jobs heap / indexes / total | attempts heap / indexes / total | outbox total | all |\n|---|---|---|---|---|\n");
        for s in &self.sizes {
            let t = |name: &str| s.tables.iter().find(|t| t.table == name);
            let three = |name: &str| {
                t(name).map_or(String::new(), |t| {
                    format!("{} / {} / {}", mib(t.heap), mib(t.indexes), mib(t.total))
                })
            };
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                s.at,
                three("jobs"),
                three("attempts"),
                t("outbox").map_or(String::new(), |t| mib(t.total)),
                mib(s.total())
            ));
        }
        md.push_str("\n| pruning window ends (s) | intake p50 / p99 / p99.9 (ms) | jobs pruned so far |\n|---|---|---|\n");
        for w in &self.windows {
            md.push_str(&format!(
                "| {:.0} | {} | {} |\n",
                w.end_s,
                ms(&w.latency),
                w.pruned
            ));
        }
        md
    }

    /// Writes `growth.json` and `growth.md` into `dir`.
    pub fn write(&self, dir: &Path) {
        std::fs::create_dir_all(dir).expect("create the report folder");
        let json = serde_json::to_string_pretty(self).expect("report json");
        std::fs::write(dir.join("growth.json"), json + "\n").expect("write growth.json");
        std::fs::write(dir.join("growth.md"), self.markdown()).expect("write growth.md");
    }
}

const FLOOR: &str = "floor";
const FILLED: &str = "filled";
const PRUNED: &str = "pruned, vacuumed";
const FULL: &str = "after VACUUM FULL";
const BACK: &str = "the intake's jobs deleted, VACUUM FULL";

fn refilled(k: usize) -> String {
    format!("refill {k}")
}

fn repruned(k: usize) -> String {
    format!("refill {k} pruned, vacuumed")
}

/// Figures in seconds, one decimal, comma-separated.
fn seconds(figures: &[f64]) -> String {
    figures
        .iter()
        .map(|s| format!("{s:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs the whole benchmark.
pub async fn growth(options: &Options) -> Report {
    let provider = mock(MockOptions::default()).await;
    let base =
        onejob::config::EMBEDDED_DEFAULT.replace("http://127.0.0.1:8081/v1", &provider.base_url());
    // The baseline's worker keeps everything; the pruning one has the defaults.
    let keep_all = format!(
        "{base}\n[retention]\nsucceeded = \"3650d\"\nfailed = \"3650d\"\ncancelled = \"3650d\"\n"
    );
    let (config_keep, file_keep) = config(&keep_all);
    let (_, file_prune) = config(&base);
    let env = TestEnv::new(&config_keep).await;
    std::fs::create_dir_all(&options.out).expect("create the report folder");
    let machine = machine(&env).await;
    say(&format!("on {machine}"));
    let mut db = PgConnection::connect(&env.database_url)
        .await
        .expect("connect to the run's database");
    let autovacuum: bool = sqlx::query_scalar("SELECT current_setting('autovacuum')::bool")
        .fetch_one(&mut db)
        .await
        .expect("read autovacuum");
    let operation = config_keep
        .operations
        .keys()
        .next()
        .expect("the embedded defaults have an operation")
        .clone();

    let producer = Arc::new(
        Producer::connect(&env.amqp_url)
            .await
            .expect("producer connects"),
    );
    let mut events = Events::watch(&env).await;
    let mut worker = Worker::start(
        &env,
        &file_keep.path,
        &options.out.join("worker-keep.log"),
        Some(free_port()),
    );
    worker.wait_ready().await;

    say("floor: a little intake, and the rows every prune must keep");
    open_loop(producer.clone(), &mut events, options.rate, 2, "w-").await;
    let mut kept = 0;
    for (prefix, status, count, age) in KEPT {
        kept += fill_jobs(&mut db, prefix, count, status, age, 0.0, &operation)
            .await
            .0;
    }
    sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body, not_before)
         SELECT 'onejob.events', 'job.succeeded', id::text || ':' || version, '{}'::jsonb,
                now() + interval '1 day'
         FROM jobs WHERE idempotency_key LIKE 'keep-unpublished-%'",
    )
    .execute(&mut db)
    .await
    .expect("hold back the kept jobs' events");
    let mut sizes = vec![sizes_at(&mut db, FLOOR).await];
    let floor_at: String = sqlx::query_scalar("SELECT now()::text")
        .fetch_one(&mut db)
        .await
        .expect("read the time");

    say(&format!(
        "fill: {} ended jobs, 31 to 61 days old",
        options.n
    ));
    let began = Instant::now();
    fill_ended(&mut db, "g1-", options.n, &operation).await;
    let (jobs_per_fill, attempts_per_fill): (i64, i64) = sqlx::query_as(
        "SELECT count(DISTINCT j.id), count(a.id) FROM jobs j LEFT JOIN attempts a ON a.job_id = j.id
         WHERE j.idempotency_key LIKE 'g1-%'",
    )
    .fetch_one(&mut db)
    .await
    .expect("count the fill's rows");
    let fill_seconds = began.elapsed().as_secs_f64();
    say(&format!("filled in {fill_seconds:.1} s"));
    sizes.push(sizes_at(&mut db, FILLED).await);

    say(&format!(
        "baseline: {:.0} intents/s for {} s, nothing pruned",
        options.rate, options.baseline_seconds
    ));
    let (baseline, _) = open_loop(
        producer.clone(),
        &mut events,
        options.rate,
        options.baseline_seconds,
        "a-",
    )
    .await;
    worker.stop().await;
    let before = kept_rows(&mut db).await;

    say("pruning: the default retention, intake running");
    let mut worker = Worker::start(
        &env,
        &file_prune.path,
        &options.out.join("worker-prune.log"),
        Some(free_port()),
    );
    worker.wait_ready().await;
    let began = Instant::now();
    let mut windows = Vec::new();
    let mut latencies = Vec::new();
    let mut intake_published = 0;
    let limit = Duration::from_secs(600 + options.n as u64 / 100);
    let mut prune_seconds = None;
    while prune_seconds.is_none() {
        assert!(
            began.elapsed() < limit,
            "the pruning did not finish within {limit:?}"
        );
        assert!(worker.running(), "the pruning worker exited");
        let prefix = format!("b{}-", windows.len());
        let (latency, timings) = open_loop(
            producer.clone(),
            &mut events,
            options.rate,
            options.window_seconds,
            &prefix,
        )
        .await;
        intake_published += timings.len();
        latencies.extend(
            timings
                .iter()
                .map(|t| Duration::from_secs_f64((t.arrived - t.due).max(0.0))),
        );
        let pruned = pruned(&worker).await;
        windows.push(Window {
            end_s: began.elapsed().as_secs_f64(),
            latency,
            pruned,
        });
        if pruned >= options.n as u64 {
            prune_seconds = Some(began.elapsed().as_secs_f64());
        }
    }
    let prune_seconds = prune_seconds.unwrap_or_default();
    let pruning = Percentiles::of(latencies);
    say(&format!(
        "pruned {} jobs in {prune_seconds:.1} s; waiting for the vacuum",
        options.n
    ));
    let began = Instant::now();
    let n = i64::try_from(options.n).expect("n fits");
    vacuumed(&mut db, n, attempts_per_fill, limit).await;
    let vacuum_wait_seconds = began.elapsed().as_secs_f64();
    sizes.push(sizes_at(&mut db, PRUNED).await);

    let mut refill_seconds = Vec::new();
    let mut refill_prune_seconds = Vec::new();
    for k in 1..=options.refills {
        say(&format!(
            "refill {k}: {} more, pruned without intake",
            options.n
        ));
        let began = Instant::now();
        fill_ended(&mut db, &format!("g{}-", k + 1), options.n, &operation).await;
        refill_seconds.push(began.elapsed().as_secs_f64());
        sizes.push(sizes_at(&mut db, &refilled(k)).await);
        let began = Instant::now();
        let all = (k as u64 + 1) * options.n as u64;
        while pruned(&worker).await < all {
            assert!(
                began.elapsed() < limit,
                "refill {k} was not pruned within {limit:?}"
            );
            assert!(worker.running(), "the pruning worker exited");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        refill_prune_seconds.push(began.elapsed().as_secs_f64());
        let fills = k as i64 + 1;
        vacuumed(&mut db, fills * n, fills * attempts_per_fill, limit).await;
        sizes.push(sizes_at(&mut db, &repruned(k)).await);
    }
    let metrics = worker.metrics().await;
    let pruned_of = |table: &str| {
        let n = metrics.value("onejob_pruned_total", &format!("table=\"{table}\""));
        if n.is_nan() { 0 } else { n as u64 }
    };
    let (pruned_jobs, pruned_attempts) = (pruned_of("jobs"), pruned_of("attempts"));
    let worker_vacuums = ["jobs", "attempts", "outbox"]
        .iter()
        .map(|t| {
            let n = metrics.value("onejob_vacuums_total", &format!("table=\"{t}\""));
            ((*t).to_owned(), if n.is_nan() { 0.0 } else { n })
        })
        .collect();
    worker.stop().await;

    let after = kept_rows(&mut db).await;
    let fill_left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE idempotency_key ~ '^g[0-9]+-'")
            .fetch_one(&mut db)
            .await
            .expect("count the fills' rows");
    let intake_found: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE idempotency_key ~ '^b[0-9]+-'")
            .fetch_one(&mut db)
            .await
            .expect("count the intake's jobs");

    say("VACUUM FULL, the worker stopped");
    let began = Instant::now();
    sqlx::raw_sql("VACUUM FULL jobs, attempts, outbox")
        .execute(&mut db)
        .await
        .expect("vacuum full");
    let vacuum_full_seconds = began.elapsed().as_secs_f64();
    sizes.push(sizes_at(&mut db, FULL).await);

    // What is left beyond the floor is the intake's own jobs (the baseline's
    // and the pruning phase's) and their outbox rows: without them, the
    // compacted tables must be the floor again.
    say("the intake's jobs deleted, VACUUM FULL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN;
         DELETE FROM outbox WHERE created_at > '{floor_at}'::timestamptz;
         DELETE FROM attempts a USING jobs j
          WHERE a.job_id = j.id AND j.idempotency_key ~ '^(a|b[0-9]+)-';
         DELETE FROM jobs WHERE idempotency_key ~ '^(a|b[0-9]+)-';
         COMMIT;"
    )))
    .execute(&mut db)
    .await
    .expect("delete the intake's jobs");
    sqlx::raw_sql("VACUUM FULL jobs, attempts, outbox")
        .execute(&mut db)
        .await
        .expect("vacuum full");
    sizes.push(sizes_at(&mut db, BACK).await);
    db.close().await.ok();
    if let Ok(producer) = Arc::try_unwrap(producer) {
        producer.close().await;
    }

    Report {
        machine,
        autovacuum,
        n: options.n,
        jobs_per_fill,
        attempts_per_fill,
        fills: options.refills + 1,
        pruned_jobs,
        pruned_attempts,
        kept,
        rate: options.rate,
        fill_seconds,
        refill_seconds,
        baseline,
        pruning,
        windows,
        prune_seconds,
        refill_prune_seconds,
        vacuum_wait_seconds,
        worker_vacuums,
        vacuum_full_seconds,
        sizes,
        fill_left,
        kept_unchanged: before == after && before.0 > 0,
        intake_published,
        intake_found,
    }
}

/// Inserts `n` ended jobs of the mix (80% succeeded, 15% failed, 5% cancelled)
/// that ended 31 to 61 days ago, with their attempts. Jobs and attempts made.
async fn fill_ended(db: &mut PgConnection, prefix: &str, n: usize, operation: &str) -> (i64, i64) {
    let n = i64::try_from(n).expect("n fits");
    fill_jobs(
        db,
        prefix,
        n,
        "mix",
        31.0 * 86400.0,
        30.0 * 86400.0,
        operation,
    )
    .await
}

/// The three tables' sizes, as `at`.
async fn sizes_at(db: &mut PgConnection, at: &str) -> Sizes {
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, pg_relation_size(oid), pg_indexes_size(oid), pg_total_relation_size(oid)
         FROM pg_class
         WHERE relname IN ('jobs', 'attempts', 'outbox') AND relnamespace = 'public'::regnamespace
         ORDER BY relname DESC",
    )
    .fetch_all(db)
    .await
    .expect("read the tables' sizes");
    let sizes = Sizes {
        at: at.to_owned(),
        tables: rows
            .into_iter()
            .map(|(table, heap, indexes, total)| Size {
                table,
                heap,
                indexes,
                total,
            })
            .collect(),
    };
    say(&format!(
        "{at}: {:.1} MiB",
        sizes.total() as f64 / (1024.0 * 1024.0)
    ));
    sizes
}

/// Every row that is not a fill's, with its attempts: how many, and a digest.
async fn kept_rows(db: &mut PgConnection) -> (i64, String) {
    sqlx::query_as(
        "SELECT count(*), md5(coalesce(string_agg(
                    j.id::text || j.status || j.version || j.updated_at::text || coalesce(a.rows, ''),
                    ',' ORDER BY j.id), ''))
         FROM jobs j
         LEFT JOIN LATERAL (
             SELECT string_agg(a.id::text || a.status || coalesce(a.finished_at::text, ''), ',' ORDER BY a.id) AS rows
             FROM attempts a WHERE a.job_id = j.id) a ON true
         WHERE j.idempotency_key !~ '^g[0-9]+-' AND j.idempotency_key !~ '^b[0-9]+-'",
    )
    .fetch_one(db)
    .await
    .expect("digest the kept rows")
}

/// The pruning worker's `onejob_pruned_total{table="jobs"}`.
async fn pruned(worker: &Worker) -> u64 {
    let n = worker
        .metrics()
        .await
        .value("onejob_pruned_total", "table=\"jobs\"");
    if n.is_nan() { 0 } else { n as u64 }
}

/// Waits until the statistics count `jobs` and `attempts` deleted rows (a
/// backend reports its counts up to ten seconds late) and then until neither
/// has more dead rows than autovacuum's threshold: whoever vacuums has caught
/// up.
async fn vacuumed(db: &mut PgConnection, jobs: i64, attempts: i64, limit: Duration) {
    let began = Instant::now();
    loop {
        let (reported, behind): (bool, i64) = sqlx::query_as(
            "SELECT bool_and(s.n_tup_del >= CASE s.relname WHEN 'jobs' THEN $1 ELSE $2 END),
                    count(*) FILTER (WHERE s.n_dead_tup > current_setting('autovacuum_vacuum_threshold')::float8
                        + current_setting('autovacuum_vacuum_scale_factor')::float8 * greatest(c.reltuples, 0))
             FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
             WHERE s.relname IN ('jobs', 'attempts') AND s.schemaname = 'public'",
        )
        .bind(jobs)
        .bind(attempts)
        .fetch_one(&mut *db)
        .await
        .expect("read the dead rows");
        if reported && behind == 0 {
            return;
        }
        assert!(
            began.elapsed() < limit,
            "the tables were not vacuumed within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
