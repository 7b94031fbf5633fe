//! Retention: ended jobs are pruned with their attempts once they have been kept
//! for their operation's retention, at its boundaries; `unknown`, `queued` and
//! `running` jobs never are, nor a job whose event is not yet published; a
//! pruned identity makes a new job; the CLI and the reconciler prune the same.

use onejob_test_support as common;

use std::time::Duration;

use common::{TestEnv, config, config_for, new_job, wait_for};
use onejob::domain::JobId;
use onejob::edges::store::{Admission, Policy, Store};
use sqlx::Connection;

/// `[retention]` and the operation's own override, as the tests use them.
fn text() -> String {
    config_for(
        &[common::P("primary", "http://127.0.0.1:9", "")],
        "retention = { succeeded = \"90m\" }",
    ) + "\n[retention]\nsucceeded = \"2h\"\nfailed = \"3h\"\ncancelled = \"2h\"\n"
}

/// Admits a job of `operation` and marks its first attempt's message published.
async fn job(store: &Store, key: &str, operation: &str) -> JobId {
    let mut new = new_job("acct_r", key, "text");
    new.intent.operation = operation.into();
    let job_id = new.job_id;
    match store.admission().admit(&[new]).await.unwrap().remove(0) {
        Admission::Created {
            publish: Some(publish),
            ..
        } => store.outbox().mark_published(&[publish.id]).await.unwrap(),
        other => panic!("expected created, got {other:?}"),
    }
    job_id
}

/// Ends a job as `status` (its attempt too), `ago` in the past: what settling it
/// then would have written. An `unknown` job's attempt is `unknown`.
async fn end(store: &Store, job: JobId, status: &str, ago: Duration) {
    let attempt_status = if status == "cancelled" {
        "cancelled"
    } else {
        status
    };
    let secs = ago.as_secs_f64();
    sqlx::query(
        "UPDATE attempts SET status = $2, finished_at = now() - make_interval(secs => $3) WHERE job_id = $1",
    )
    .bind(job.0)
    .bind(attempt_status)
    .bind(secs)
    .execute(store.pool())
    .await
    .unwrap();
    sqlx::query(
        "UPDATE jobs SET status = $2, version = version + 1,
             completed_by = CASE WHEN $2 = 'succeeded' THEN (SELECT id FROM attempts WHERE job_id = $1) END,
             result = CASE WHEN $2 = 'succeeded' THEN '{\"summary\": \"s\"}'::jsonb END,
             updated_at = now() - make_interval(secs => $3)
         WHERE id = $1",
    )
    .bind(job.0)
    .bind(status)
    .bind(secs)
    .execute(store.pool())
    .await
    .unwrap();
}

/// A job of `operation` that ended as `status`, `ago` in the past.
async fn ended(store: &Store, key: &str, operation: &str, status: &str, ago: Duration) -> JobId {
    let id = job(store, key, operation).await;
    end(store, id, status, ago).await;
    id
}

async fn exists(store: &Store, job: JobId) -> (bool, i64) {
    let (jobs, attempts): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM jobs WHERE id = $1), (SELECT count(*) FROM attempts WHERE job_id = $1)",
    )
    .bind(job.0)
    .fetch_one(store.pool())
    .await
    .unwrap();
    (jobs == 1, attempts)
}

fn minutes(m: u64) -> Duration {
    Duration::from_secs(m * 60)
}

/// The jobs of the retention test: each just inside or just outside its
/// window, those never pruned however old, and one held by its event
/// (`event`, its outbox row, not yet published).
struct Jobs {
    inside: JobId,
    outside: JobId,
    failed_inside: JobId,
    failed_outside: JobId,
    cancelled_outside: JobId,
    retired_inside: JobId,
    retired_outside: JobId,
    unknown: JobId,
    queued: JobId,
    running: JobId,
    unpublished: JobId,
    event: i64,
}

impl Jobs {
    async fn admit(store: &Store) -> Jobs {
        let ended =
            |key, operation, status, ago| ended(store, key, operation, status, minutes(ago));
        // summarize's own retention for succeeded jobs: 90 minutes.
        let inside = ended("inside", "summarize", "succeeded", 89).await;
        let outside = ended("outside", "summarize", "succeeded", 91).await;
        // Failed and cancelled fall back to [retention]: 3 hours and 2 hours.
        let failed_inside = ended("failed-inside", "summarize", "failed", 179).await;
        let failed_outside = ended("failed-outside", "summarize", "failed", 181).await;
        let cancelled_outside = ended("cancelled-outside", "summarize", "cancelled", 121).await;
        // An operation no longer configured: [retention] alone (2 hours).
        let retired_inside = ended("retired-inside", "retired", "succeeded", 119).await;
        let retired_outside = ended("retired-outside", "retired", "succeeded", 121).await;
        // Never pruned, however old: unknown, queued, running.
        let (unknown, queued, running) = never_pruned(store).await;
        // Past its retention, but its job.succeeded event is not published yet.
        let (unpublished, event) = held_by_its_event(store).await;
        Jobs {
            inside,
            outside,
            failed_inside,
            failed_outside,
            cancelled_outside,
            retired_inside,
            retired_outside,
            unknown,
            queued,
            running,
            unpublished,
            event,
        }
    }
}

/// An unknown, a queued and a running job, each 400 days old.
async fn never_pruned(store: &Store) -> (JobId, JobId, JobId) {
    let unknown = job(store, "unknown", "summarize").await;
    end(
        store,
        unknown,
        "unknown",
        Duration::from_secs(400 * 24 * 3600),
    )
    .await;
    let queued = job(store, "queued", "summarize").await;
    sqlx::query("UPDATE jobs SET created_at = now() - interval '400 days', updated_at = now() - interval '400 days' WHERE id = $1")
        .bind(queued.0)
        .execute(store.pool())
        .await
        .unwrap();
    let running = job(store, "running", "summarize").await;
    sqlx::query("UPDATE jobs SET status = 'running', updated_at = now() - interval '400 days' WHERE id = $1")
        .bind(running.0)
        .execute(store.pool())
        .await
        .unwrap();
    (unknown, queued, running)
}

/// A job past its retention whose job.succeeded event is not published yet,
/// and the event's outbox row.
async fn held_by_its_event(store: &Store) -> (JobId, i64) {
    let unpublished = ended(store, "unpublished", "summarize", "succeeded", minutes(200)).await;
    let event: (i64,) = sqlx::query_as(
        "INSERT INTO outbox (exchange, routing_key, message_id, body)
         SELECT 'onejob.events', 'job.succeeded', id::text || ':' || version, '{}'::jsonb FROM jobs WHERE id = $1
         RETURNING id",
    )
    .bind(unpublished.0)
    .fetch_one(store.pool())
    .await
    .unwrap();
    (unpublished, event.0)
}

#[tokio::test]
async fn retention_prunes_just_outside_its_window_and_nothing_else() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let store = &env.store;
    let policy = Policy::of(&config);

    let jobs = Jobs::admit(store).await;
    let retention = store.retention();

    // A dry run counts, and deletes nothing.
    let dry = retention.prune_jobs(&policy, i64::MAX, true).await.unwrap();
    assert_eq!((dry.pruned.jobs, dry.pruned.attempts), (4, 4));
    let oldest = dry.oldest.expect("the oldest prunable job's age");
    assert!(
        oldest >= minutes(181) && oldest < minutes(183),
        "{oldest:?}"
    );
    assert!(exists(store, jobs.outside).await.0);

    // Pruned in batches of one, to the same four.
    let batches = retention.prune_batches(&policy, 1, 100, Duration::ZERO, || false);
    let pass = batches.await.unwrap();
    assert_eq!((pass.pruned.jobs, pass.pruned.attempts), (4, 4));
    for gone in [
        jobs.outside,
        jobs.failed_outside,
        jobs.cancelled_outside,
        jobs.retired_outside,
    ] {
        assert_eq!(
            exists(store, gone).await,
            (false, 0),
            "{gone} pruned, attempts and all"
        );
    }
    for kept in [
        jobs.inside,
        jobs.failed_inside,
        jobs.retired_inside,
        jobs.unknown,
        jobs.queued,
        jobs.running,
        jobs.unpublished,
    ] {
        assert_eq!(exists(store, kept).await, (true, 1), "{kept} kept");
    }
    let prune = || async {
        let pass = retention.prune_jobs(&policy, 100, false).await;
        pass.unwrap().pruned.jobs
    };
    assert_eq!(prune().await, 0);

    // Once its event is published, the held job goes too.
    store.outbox().mark_published(&[jobs.event]).await.unwrap();
    assert_eq!(prune().await, 1);
    assert!(!exists(store, jobs.unpublished).await.0);

    // A pruned identity makes a new job; a kept one is still a duplicate.
    let again = new_job("acct_r", "outside", "text");
    let new_id = again.job_id;
    match store.admission().admit(&[again]).await.unwrap().remove(0) {
        Admission::Created { job_id, .. } => assert_eq!(job_id, new_id),
        other => panic!("a pruned identity makes a new job, got {other:?}"),
    }
    match store
        .admission()
        .admit(&[new_job("acct_r", "inside", "text")])
        .await
        .unwrap()
        .remove(0)
    {
        Admission::Duplicate { job_id } => assert_eq!(job_id, jobs.inside),
        other => panic!("inside its window an identity is a duplicate, got {other:?}"),
    }
}

#[tokio::test]
async fn the_cli_prunes_by_age_and_counts_first() {
    let text = text();
    let (config, file) = config(&text);
    let env = TestEnv::new(&config).await;
    let store = &env.store;
    let old = ended(store, "old", "summarize", "succeeded", minutes(30)).await;
    let recent = ended(store, "recent", "summarize", "succeeded", minutes(5)).await;

    // The configured retention (90 minutes) prunes neither.
    let out = env.cli_ok(&file.path, &["jobs", "prune", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"], 0, "{v}");

    let out = env.cli_ok(
        &file.path,
        &[
            "jobs",
            "prune",
            "--older-than",
            "10m",
            "--dry-run",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            v["dry_run"].as_bool(),
            v["jobs"].as_u64(),
            v["attempts"].as_u64()
        ),
        (Some(true), Some(1), Some(1)),
        "{v}"
    );
    assert!(exists(store, old).await.0);

    let out = env.cli_ok(&file.path, &["jobs", "prune", "--older-than", "10m"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.starts_with("pruned 1 ended jobs and 1 attempts"),
        "{said}"
    );
    assert!(!exists(store, old).await.0);
    assert!(exists(store, recent).await.0);

    let bad = env.cli(&file.path, &["jobs", "prune", "--older-than", "0s"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--older-than"));
    let bad = env.cli(&file.path, &["jobs", "prune", "--older-than", "soon"]);
    assert_eq!(bad.status.code(), Some(2), "a bad duration is bad usage");
}

#[tokio::test]
async fn the_reconciler_prunes_on_its_own() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let store = &env.store;
    let old = ended(store, "old", "summarize", "succeeded", minutes(95)).await;
    let kept = ended(store, "kept", "summarize", "succeeded", minutes(85)).await;

    let fleet = env
        .fleet(config.clone(), vec![onejob::fleet::Role::Reconciler])
        .await;
    wait_for(
        "the reconciler to prune the old job",
        Duration::from_secs(30),
        || async { (!exists(store, old).await.0).then_some(()) },
    )
    .await;
    assert!(exists(store, kept).await.0);
    // The worker context installed the recorder: the pass is counted.
    let metrics = onejob::edges::metrics::render();
    fleet.stop().await;
    assert!(
        metrics.contains("onejob_pruned_total{table=\"jobs\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("onejob_oldest_prunable_job_seconds"),
        "{metrics}"
    );
}

/// Where the server runs no autovacuum (this machine's CI configuration says
/// `autovacuum = off`), pruned rows would hold their space forever: onejob
/// vacuums its own tables once their dead rows pass autovacuum's threshold.
/// Where autovacuum runs (Postgres's default, and `compose.yaml`), it leaves
/// that to the server: once the statistics show the pruned rows dead past that
/// same threshold (or the server has vacuumed them already), onejob vacuums
/// nothing. Either way the test asserts what the server's setting calls for.
#[tokio::test]
async fn pruned_space_is_vacuumed_where_the_server_runs_no_autovacuum() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    let store = &env.store;
    let autovacuum: bool = sqlx::query_scalar("SELECT current_setting('autovacuum')::bool")
        .fetch_one(store.pool())
        .await
        .unwrap();
    // A fresh database has no dead rows: nothing to do.
    assert_eq!(
        store.retention().vacuum_if_due().await.unwrap(),
        Vec::<String>::new()
    );

    for i in 0..300 {
        ended(
            store,
            &format!("old-{i}"),
            "summarize",
            "succeeded",
            minutes(200),
        )
        .await;
    }
    let pass = store
        .retention()
        .prune_jobs(&Policy::of(&config), 1000, false)
        .await
        .unwrap();
    assert_eq!(pass.pruned.jobs, 300);
    if autovacuum {
        left_to_autovacuum(store).await;
    } else {
        vacuumed_by_onejob(store).await;
    }
}

/// Where autovacuum runs: once the pruned rows are reported dead, onejob
/// vacuums nothing, and leaves them to the server.
async fn left_to_autovacuum(store: &onejob::edges::store::Store) {
    // The statistics count the deletes (a backend reports within ten
    // seconds of going idle); then each table either holds its dead rows
    // past the threshold, the moment onejob would vacuum were autovacuum
    // off, or the server's autovacuum has been there already.
    wait_for(
        "the pruned jobs' deletes to be reported",
        Duration::from_secs(30),
        || async {
            let (deleted,): (i64,) = sqlx::query_as(
                "SELECT n_tup_del FROM pg_stat_user_tables
                 WHERE relname = 'jobs' AND schemaname = current_schema()",
            )
            .fetch_one(store.pool())
            .await
            .unwrap();
            (deleted >= 300).then_some(())
        },
    )
    .await;
    let due_or_done = |store: &onejob::edges::store::Store| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_as::<_, (String, bool, i64)>(
                "SELECT s.relname::text,
                        s.n_dead_tup > current_setting('autovacuum_vacuum_threshold')::float8
                            + current_setting('autovacuum_vacuum_scale_factor')::float8
                              * greatest(c.reltuples, 0)
                        OR s.autovacuum_count > 0,
                        s.vacuum_count
                 FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
                 WHERE s.relname IN ('jobs', 'attempts') AND s.schemaname = current_schema()
                 ORDER BY s.relname",
            )
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    for (table, due, _) in due_or_done(store).await {
        assert!(
            due,
            "{table}: dead rows neither past the threshold nor autovacuumed"
        );
    }
    assert_eq!(
        store.retention().vacuum_if_due().await.unwrap(),
        Vec::<String>::new(),
        "autovacuum runs: onejob leaves the dead rows to it"
    );
    for (table, _, manual) in due_or_done(store).await {
        assert_eq!(
            manual, 0,
            "{table} was vacuumed by hand where autovacuum runs"
        );
    }
}

/// Where autovacuum is off: once the pruned rows are dead past the threshold,
/// onejob vacuums `jobs` and `attempts`, once each, with their statistics.
async fn vacuumed_by_onejob(store: &onejob::edges::store::Store) {
    // A backend reports its statistics within ten seconds of going idle.
    // Each table's statistics arrive on their own: a pass may find one due
    // before the other, so the tables vacuumed are gathered across passes.
    let gathered = std::sync::Mutex::new(Vec::<String>::new());
    let vacuumed = wait_for(
        "the pruned jobs' and attempts' dead rows to pass the threshold",
        Duration::from_secs(30),
        || async {
            let tables = store.retention().vacuum_if_due().await.unwrap();
            let mut all = gathered.lock().unwrap();
            all.extend(tables);
            (all.contains(&"jobs".to_owned()) && all.contains(&"attempts".to_owned()))
                .then(|| all.clone())
        },
    )
    .await;
    assert!(vacuumed.contains(&"attempts".to_owned()), "{vacuumed:?}");
    // Each was vacuumed once, with its statistics (a vacuum reports at once).
    let counts: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, vacuum_count, analyze_count FROM pg_stat_user_tables
         WHERE relname IN ('jobs', 'attempts') AND schemaname = current_schema() ORDER BY relname",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(
        counts,
        vec![("attempts".to_owned(), 1, 1), ("jobs".to_owned(), 1, 1)]
    );
}

/// A pruning batch finds and deletes its jobs through indexes: it reads neither
/// `jobs` nor `attempts` whole, however many there are. (Deleting a succeeded
/// job's winning attempt makes the `completed_by` foreign key look for jobs that
/// name it: without an index, one read of the whole jobs table per attempt, and
/// a batch of a thousand ran for minutes on a million jobs.)
#[tokio::test]
async fn a_pruning_batch_reads_no_table_whole() {
    let (config, _file) = config(&text());
    let env = TestEnv::new(&config).await;
    // Every connection that wrote is closed before the counters are read: a
    // backend reports its counts when it exits (else up to ten seconds late).
    env.store.close().await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    // Enough rows that reading a table whole costs more than its indexes.
    let (jobs, attempts) = common::fill_jobs(
        &mut db,
        "old-",
        20_000,
        "mix",
        86400.0,
        86400.0,
        "summarize",
    )
    .await;
    // Pending outbox rows hold a few of them: events, an attempt message. (The
    // fill's ids are known: no read of the tables to find them.)
    sqlx::query(
        "INSERT INTO outbox (exchange, routing_key, message_id, body)
         SELECT 'onejob.events', 'job.succeeded', md5(k)::uuid::text || ':3', '{}'::jsonb
         FROM unnest(ARRAY['old-5', 'old-6']) k
         UNION ALL
         SELECT 'onejob', 'attempts.primary', md5(md5('old-7')::uuid::text || '-1')::uuid::text, '{}'::jsonb",
    )
    .execute(&mut db)
    .await
    .unwrap();
    sqlx::raw_sql("ANALYZE jobs, attempts, outbox")
        .execute(&mut db)
        .await
        .unwrap();
    db.close().await.unwrap();
    let before = scans(&env.database_url, jobs, attempts, 0).await;
    let store = Store::connect(
        &env.database_url,
        1,
        onejob::shared::runtime::routes(&config),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let pass = store
        .retention()
        .prune_jobs(&Policy::older_than(Duration::from_secs(3600)), 1000, false)
        .await
        .unwrap();
    assert_eq!(pass.pruned.jobs, 1000);
    store.close().await;
    let after = scans(&env.database_url, jobs, attempts, 1000).await;
    assert_eq!(
        after, before,
        "sequential scans of (attempts, jobs) during one pruning batch"
    );
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE idempotency_key IN ('old-5', 'old-6', 'old-7')",
    )
    .fetch_one(&mut db)
    .await
    .unwrap();
    assert_eq!(held, 3, "the held jobs are kept");
}

/// Sequential scans of `attempts` and `jobs` so far, once the statistics count
/// `jobs` and `attempts` rows inserted and at least `deleted` of each deleted.
async fn scans(url: &str, jobs: i64, attempts: i64, deleted: i64) -> (i64, i64) {
    wait_for(
        "the statistics to count every write",
        Duration::from_secs(30),
        || async {
            let mut stats = sqlx::PgConnection::connect(url).await.unwrap();
            let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
                "SELECT relname::text, n_tup_ins, n_tup_del, seq_scan FROM pg_stat_user_tables
                 WHERE relname IN ('attempts', 'jobs') AND schemaname = current_schema()
                 ORDER BY relname",
            )
            .fetch_all(&mut stats)
            .await
            .unwrap();
            stats.close().await.ok();
            let counted = rows[0].1 == attempts
                && rows[1].1 == jobs
                && rows[0].2 >= deleted
                && rows[1].2 >= deleted;
            counted.then(|| (rows[0].3, rows[1].3))
        },
    )
    .await
}
