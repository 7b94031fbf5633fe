//! The phases of a growth run, in order: the floor, the first fill, the
//! baseline, the pruning under intake, the refills, and the compaction.

use std::sync::Arc;
use std::time::{Duration, Instant};

use onejob::settings::config::Config;
use onejob_producer::Producer;
use sqlx::{Connection, PgConnection};

use super::Options;
use super::report::{BACK, FILLED, FLOOR, FULL, PRUNED, Sizes, Window, refilled, repruned};
use super::tables::{KEPT, fill_ended, pruned, sizes_at, vacuumed};
use crate::drain::{Events, Percentiles, Worker, open_loop, say};
use crate::{TestEnv, fill_jobs};

/// What the phases share: the options, a connection to the run's database,
/// the intake's producer and the events it waits for, the operation the fills
/// are of, and the tables' sizes so far.
pub(super) struct Run<'a> {
    pub(super) options: &'a Options,
    pub(super) db: PgConnection,
    pub(super) producer: Arc<Producer>,
    pub(super) events: Events,
    pub(super) operation: String,
    pub(super) sizes: Vec<Sizes>,
}

/// What the first fill made, read back from the tables, and how long it took.
pub(super) struct Fill {
    pub(super) jobs: i64,
    pub(super) attempts: i64,
    pub(super) seconds: f64,
}

/// What the pruning phase measured.
pub(super) struct Pruning {
    pub(super) windows: Vec<Window>,
    pub(super) latency: Percentiles,
    pub(super) intake_published: usize,
    pub(super) prune_seconds: f64,
    pub(super) vacuum_wait_seconds: f64,
}

/// Each refill's statement, and the time until its last job was pruned.
pub(super) struct Refills {
    pub(super) seconds: Vec<f64>,
    pub(super) prune_seconds: Vec<f64>,
}

impl<'a> Run<'a> {
    /// Connects to `env`'s database and its broker, for a run of `options`
    /// with `config`'s first operation. The run, and whether the server runs
    /// autovacuum.
    pub(super) async fn open(
        env: &TestEnv,
        config: &Config,
        options: &'a Options,
    ) -> (Run<'a>, bool) {
        let mut db = PgConnection::connect(&env.database_url)
            .await
            .expect("connect to the run's database");
        let autovacuum: bool = sqlx::query_scalar("SELECT current_setting('autovacuum')::bool")
            .fetch_one(&mut db)
            .await
            .expect("read autovacuum");
        let operation = config
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
        let events = Events::watch(env).await;
        let run = Run {
            options,
            db,
            producer,
            events,
            operation,
            sizes: Vec::new(),
        };
        (run, autovacuum)
    }

    /// How long the pruning of a fill, or the vacuum after it, may take.
    fn limit(&self) -> Duration {
        Duration::from_secs(600 + self.options.n as u64 / 100)
    }

    /// N as the tables count it.
    fn n(&self) -> i64 {
        i64::try_from(self.options.n).expect("n fits")
    }

    /// The floor: a little intake, and the rows every prune must keep (the
    /// unpublished ones with their events held back). How many rows were
    /// kept, and the time the floor was measured at.
    pub(super) async fn floor(&mut self) -> (i64, String) {
        say("floor: a little intake, and the rows every prune must keep");
        open_loop(
            self.producer.clone(),
            &mut self.events,
            self.options.rate,
            2,
            "w-",
        )
        .await;
        let mut kept = 0;
        for (prefix, status, count, age) in KEPT {
            kept += fill_jobs(
                &mut self.db,
                prefix,
                count,
                status,
                age,
                0.0,
                &self.operation,
            )
            .await
            .0;
        }
        sqlx::query(
            "INSERT INTO outbox (exchange, routing_key, message_id, body, not_before)
             SELECT 'onejob.events', 'job.succeeded', id::text || ':' || version, '{}'::jsonb,
                    now() + interval '1 day'
             FROM jobs WHERE idempotency_key LIKE 'keep-unpublished-%'",
        )
        .execute(&mut self.db)
        .await
        .expect("hold back the kept jobs' events");
        self.sizes.push(sizes_at(&mut self.db, FLOOR).await);
        let floor_at: String = sqlx::query_scalar("SELECT now()::text")
            .fetch_one(&mut self.db)
            .await
            .expect("read the time");
        (kept, floor_at)
    }

    /// The first fill: N ended jobs, 31 to 61 days old.
    pub(super) async fn fill(&mut self) -> Fill {
        say(&format!(
            "fill: {} ended jobs, 31 to 61 days old",
            self.options.n
        ));
        let began = Instant::now();
        fill_ended(&mut self.db, "g1-", self.options.n, &self.operation).await;
        let (jobs, attempts): (i64, i64) = sqlx::query_as(
            "SELECT count(DISTINCT j.id), count(a.id) FROM jobs j LEFT JOIN attempts a ON a.job_id = j.id
             WHERE j.idempotency_key LIKE 'g1-%'",
        )
        .fetch_one(&mut self.db)
        .await
        .expect("count the fill's rows");
        let seconds = began.elapsed().as_secs_f64();
        say(&format!("filled in {seconds:.1} s"));
        self.sizes.push(sizes_at(&mut self.db, FILLED).await);
        Fill {
            jobs,
            attempts,
            seconds,
        }
    }

    /// The baseline: the intake's latency while nothing is pruned.
    pub(super) async fn baseline(&mut self) -> Percentiles {
        say(&format!(
            "baseline: {:.0} intents/s for {} s, nothing pruned",
            self.options.rate, self.options.baseline_seconds
        ));
        open_loop(
            self.producer.clone(),
            &mut self.events,
            self.options.rate,
            self.options.baseline_seconds,
            "a-",
        )
        .await
        .latency
    }

    /// The pruning: intake in windows while `worker` prunes, until it has
    /// pruned all N; then the wait for the vacuum.
    pub(super) async fn prune(&mut self, worker: &mut Worker, attempts_per_fill: i64) -> Pruning {
        let began = Instant::now();
        let mut windows = Vec::new();
        let mut latencies = Vec::new();
        let mut intake_published = 0;
        let limit = self.limit();
        let mut prune_seconds = None;
        while prune_seconds.is_none() {
            assert!(
                began.elapsed() < limit,
                "the pruning did not finish within {limit:?}"
            );
            assert!(worker.running(), "the pruning worker exited");
            let prefix = format!("b{}-", windows.len());
            let window = open_loop(
                self.producer.clone(),
                &mut self.events,
                self.options.rate,
                self.options.window_seconds,
                &prefix,
            )
            .await;
            let (latency, timings) = (window.latency, window.timings);
            intake_published += timings.len();
            latencies.extend(
                timings
                    .iter()
                    .map(|t| Duration::from_secs_f64((t.arrived - t.due).max(0.0))),
            );
            let pruned = pruned(worker).await;
            windows.push(Window {
                end_s: began.elapsed().as_secs_f64(),
                latency,
                pruned,
            });
            if pruned >= self.options.n as u64 {
                prune_seconds = Some(began.elapsed().as_secs_f64());
            }
        }
        let prune_seconds = prune_seconds.unwrap_or_default();
        let latency = Percentiles::of(latencies);
        say(&format!(
            "pruned {} jobs in {prune_seconds:.1} s; waiting for the vacuum",
            self.options.n
        ));
        let began = Instant::now();
        let n = self.n();
        vacuumed(&mut self.db, n, attempts_per_fill, limit).await;
        let vacuum_wait_seconds = began.elapsed().as_secs_f64();
        self.sizes.push(sizes_at(&mut self.db, PRUNED).await);
        Pruning {
            windows,
            latency,
            intake_published,
            prune_seconds,
            vacuum_wait_seconds,
        }
    }

    /// The refills: N more each, pruned by `worker` without intake, and
    /// vacuumed.
    pub(super) async fn refills(&mut self, worker: &mut Worker, attempts_per_fill: i64) -> Refills {
        let (limit, n) = (self.limit(), self.n());
        let mut refill_seconds = Vec::new();
        let mut refill_prune_seconds = Vec::new();
        for k in 1..=self.options.refills {
            say(&format!(
                "refill {k}: {} more, pruned without intake",
                self.options.n
            ));
            let began = Instant::now();
            let prefix = format!("g{}-", k + 1);
            fill_ended(&mut self.db, &prefix, self.options.n, &self.operation).await;
            refill_seconds.push(began.elapsed().as_secs_f64());
            self.sizes.push(sizes_at(&mut self.db, &refilled(k)).await);
            let began = Instant::now();
            let all = (k as u64 + 1) * self.options.n as u64;
            while pruned(worker).await < all {
                assert!(
                    began.elapsed() < limit,
                    "refill {k} was not pruned within {limit:?}"
                );
                assert!(worker.running(), "the pruning worker exited");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            refill_prune_seconds.push(began.elapsed().as_secs_f64());
            let fills = k as i64 + 1;
            vacuumed(&mut self.db, fills * n, fills * attempts_per_fill, limit).await;
            self.sizes.push(sizes_at(&mut self.db, &repruned(k)).await);
        }
        Refills {
            seconds: refill_seconds,
            prune_seconds: refill_prune_seconds,
        }
    }

    /// What is left once the worker has stopped: the rows of the fills, and
    /// the intake's jobs.
    pub(super) async fn leftovers(&mut self) -> (i64, i64) {
        let fill_left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM jobs WHERE idempotency_key ~ '^g[0-9]+-'")
                .fetch_one(&mut self.db)
                .await
                .expect("count the fills' rows");
        let intake_found: i64 =
            sqlx::query_scalar("SELECT count(*) FROM jobs WHERE idempotency_key ~ '^b[0-9]+-'")
                .fetch_one(&mut self.db)
                .await
                .expect("count the intake's jobs");
        (fill_left, intake_found)
    }

    /// VACUUM FULL, the worker stopped; how long it took. Then the intake's
    /// jobs are deleted and the tables compacted again.
    pub(super) async fn compact(&mut self, floor_at: &str) -> f64 {
        say("VACUUM FULL, the worker stopped");
        let began = Instant::now();
        sqlx::raw_sql("VACUUM FULL jobs, attempts, outbox")
            .execute(&mut self.db)
            .await
            .expect("vacuum full");
        let vacuum_full_seconds = began.elapsed().as_secs_f64();
        self.sizes.push(sizes_at(&mut self.db, FULL).await);

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
        .execute(&mut self.db)
        .await
        .expect("delete the intake's jobs");
        sqlx::raw_sql("VACUUM FULL jobs, attempts, outbox")
            .execute(&mut self.db)
            .await
            .expect("vacuum full");
        self.sizes.push(sizes_at(&mut self.db, BACK).await);
        vacuum_full_seconds
    }

    /// Closes the connection and the producer; the sizes measured.
    pub(super) async fn close(self) -> Vec<Sizes> {
        self.db.close().await.ok();
        if let Ok(producer) = Arc::try_unwrap(self.producer) {
            producer.close().await;
        }
        self.sizes
    }
}

/// The worker's `onejob_pruned_total` for jobs and attempts, and its
/// `onejob_vacuums_total` by table.
pub(super) async fn worker_counts(worker: &Worker) -> (u64, u64, Vec<(String, f64)>) {
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
    (pruned_jobs, pruned_attempts, worker_vacuums)
}
