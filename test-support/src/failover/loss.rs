//! What asynchronous replication loses: the asynchronous cluster's primary
//! crashed in the middle of a stream of intents, and then what the new
//! primary holds against what the broker confirmed and the provider ran.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use onejob_producer::Producer;
use sqlx::{Connection, PgConnection};

use super::Options;
use super::site::Site;
use crate::drain::say;
use crate::intent;

/// What the crash cost.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Loss {
    /// Distinct intents streamed, each confirmed by the broker.
    pub intents: usize,
    /// Their events that had arrived when the primary crashed.
    pub succeeded_before_crash: usize,
    /// From the crash until a primary took writes through HAProxy.
    pub crash_to_first_write_s: f64,
    /// Confirmed intents the new primary has no job for: acknowledged by
    /// onejob once their job committed on the old primary, then lost with it.
    pub intents_without_job: usize,
    /// Of those, the ones whose `job.succeeded` event had been published.
    pub events_of_lost_jobs: usize,
    /// Provider calls in the phase, and attempts called more than once.
    pub calls: usize,
    pub calls_twice: usize,
    /// Settlements that found their claim lost (`onejob_claims_lost_total`
    /// of the worker): each attempt's answer was paid for and not kept.
    pub claims_lost: u64,
    /// Jobs still open when the phase ended (queued, running or unknown).
    pub jobs_open: i64,
    /// Of them, `unknown`: a settlement lost, its attempt `started` again
    /// until the vanished sweep (no evidence is configured here).
    pub jobs_unknown: i64,
}

/// Streams `options.loss_n` intents as fast as the broker confirms them,
/// crashes the primary once a third have succeeded, and counts once the
/// site is quiet.
pub async fn loss(site: &mut Site, options: &Options) -> Loss {
    let ha = site.ha.as_ref().expect("the loss phase runs on a cluster");
    say(&format!(
        "asynchronous loss: {} intents streamed, the primary crashed a third of the way",
        options.loss_n
    ));
    let calls_before = site.provider.stats.idempotency_keys().len();
    let stream = tokio::spawn(stream(site.producer.clone(), options.loss_n));
    let mut succeeded: HashSet<String> = HashSet::new();
    while succeeded.len() < options.loss_n / 3 {
        succeeded.extend(
            site.events
                .arrived()
                .into_iter()
                .filter(|k| k.starts_with("a-")),
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let succeeded_before_crash = succeeded.len();
    let old = ha.primary();
    let crashed = Instant::now();
    ha.script(&["crash", &old.to_string()]);
    ha.wait_primary(old);
    let crash_to_first_write_s = crashed.elapsed().as_secs_f64();
    stream.await.expect("the stream of intents");
    wait_quiet(&site.env.database_url, &mut site.events, &mut succeeded).await;
    let jobs = job_keys(&site.env.database_url).await;
    let missing: Vec<String> = (0..options.loss_n)
        .map(|i| format!("a-{i}"))
        .filter(|k| !jobs.contains(k))
        .collect();
    let calls = site.provider.stats.idempotency_keys()[calls_before..].to_vec();
    let distinct: HashSet<&String> = calls.iter().collect();
    let (jobs_open, jobs_unknown) = open_jobs(&site.env.database_url).await;
    let lost = site
        .worker
        .metrics()
        .await
        .value("onejob_claims_lost_total", "provider=\"primary\"");
    let claims_lost = if lost.is_nan() { 0 } else { lost as u64 };
    Loss {
        intents: options.loss_n,
        succeeded_before_crash,
        crash_to_first_write_s,
        events_of_lost_jobs: missing.iter().filter(|k| succeeded.contains(*k)).count(),
        intents_without_job: missing.len(),
        calls: calls.len(),
        calls_twice: calls.len() - distinct.len(),
        claims_lost,
        jobs_open,
        jobs_unknown,
    }
}

/// Publishes `n` intents (keys `a-0`…), 256 at a time, each confirmed.
async fn stream(producer: Arc<Producer>, n: usize) {
    futures_util::stream::iter(0..n)
        .map(|i| {
            let producer = producer.clone();
            async move {
                producer
                    .publish_only(&intent("bench", &format!("a-{i}"), "x"))
                    .await
                    .expect("intent publish confirmed");
            }
        })
        .buffer_unordered(256)
        .for_each(|()| async {})
        .await;
}

/// Waits until no job is queued or running (an `unknown` one waits for a
/// person or evidence), or until a minute passes with no job ending and no
/// event arriving (four minutes at most), gathering the events' keys. The
/// sweeps that find lost claims and settlements run within it.
async fn wait_quiet(
    database_url: &str,
    events: &mut crate::drain::Events,
    succeeded: &mut HashSet<String>,
) {
    let began = Instant::now();
    let mut last = (usize::MAX, i64::MAX);
    let mut since = Instant::now();
    while began.elapsed() < Duration::from_secs(240) {
        succeeded.extend(events.arrived().into_iter().filter(|k| k.starts_with("a-")));
        let (open, unknown) = open_jobs(database_url).await;
        if open == unknown && open >= 0 {
            return;
        }
        let now = (succeeded.len(), open);
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() > Duration::from_secs(60) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    say(
        "asynchronous loss: jobs still queued or running after four minutes; counting as it stands",
    );
}

/// The keys of the phase's jobs on the primary now.
async fn job_keys(database_url: &str) -> HashSet<String> {
    let mut conn = PgConnection::connect(database_url)
        .await
        .expect("connect to read the jobs");
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM jobs WHERE idempotency_key LIKE 'a-%'")
            .fetch_all(&mut conn)
            .await
            .expect("read the jobs");
    conn.close().await.ok();
    keys.into_iter().collect()
}

/// Jobs open (queued, running or unknown), and of them unknown; -1 when
/// the primary does not answer.
async fn open_jobs(database_url: &str) -> (i64, i64) {
    let read = async {
        let mut conn = PgConnection::connect(database_url).await.ok()?;
        let counts: (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status IN ('queued', 'running', 'unknown')),
                    count(*) FILTER (WHERE status = 'unknown') FROM jobs",
        )
        .fetch_one(&mut conn)
        .await
        .ok()?;
        conn.close().await.ok();
        Some(counts)
    };
    read.await.unwrap_or((-1, -1))
}
