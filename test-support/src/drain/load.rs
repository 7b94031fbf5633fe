//! The load a benchmark puts on the worker, and what comes back: the
//! preloaded backlog, the open-loop generator, the `job.succeeded` events as
//! they arrive, and where each job's latency went.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use onejob_producer::Producer;
use sqlx::{Connection, PgConnection};

use super::parts::no_ack_consumer;
use super::{Percentiles, bar};
use crate::{TestEnv, intent};

/// Publishes `n` distinct intents and `duplicates` repeats of early ones,
/// each repeat after its original, while no worker runs.
pub async fn preload(producer: &Producer, n: usize, duplicates: usize) {
    let mut keys = Vec::with_capacity(n + duplicates);
    let mut repeated = 0;
    for i in 0..n {
        keys.push(format!("d-{i}"));
        if i % 4 == 3 && repeated < duplicates {
            keys.push(format!("d-{repeated}"));
            repeated += 1;
        }
    }
    while repeated < duplicates {
        keys.push(format!("d-{repeated}"));
        repeated += 1;
    }
    let progress = bar(keys.len() as u64, "preloading the backlog");
    futures_util::stream::iter(keys)
        .map(|key| async move {
            producer
                .publish_only(&intent("bench", &key, "x"))
                .await
                .expect("preload publish confirmed");
        })
        .buffer_unordered(256)
        .for_each(|()| async { progress.inc(1) })
        .await;
    progress.finish_and_clear();
}

/// The `job.succeeded` events, as they arrive.
pub struct Events {
    succeeded: Arc<AtomicUsize>,
    other: Arc<AtomicUsize>,
    arrivals: tokio::sync::mpsc::UnboundedReceiver<(String, Instant)>,
}

impl Events {
    pub async fn watch(env: &TestEnv) -> Events {
        let conn = env.amqp().await;
        let (ch, queue) = env.watch_events(&conn).await;
        let mut consumer = no_ack_consumer(&ch, &queue).await;
        let succeeded = Arc::new(AtomicUsize::new(0));
        let (tx, arrivals) = tokio::sync::mpsc::unbounded_channel();
        let other = Arc::new(AtomicUsize::new(0));
        let (count, others) = (succeeded.clone(), other.clone());
        tokio::spawn(async move {
            let _conn = conn;
            while let Some(Ok(delivery)) = consumer.next().await {
                let at = Instant::now();
                let event: serde_json::Value =
                    serde_json::from_slice(&delivery.data).unwrap_or_default();
                if delivery.routing_key.as_str() != "job.succeeded" {
                    eprintln!("drain: unexpected event {event}");
                    others.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                count.fetch_add(1, Ordering::SeqCst);
                let key = event["idempotency_key"].as_str().unwrap_or_default();
                let _ = tx.send((key.to_owned(), at));
            }
        });
        Events {
            succeeded,
            other,
            arrivals,
        }
    }

    pub fn succeeded(&self) -> usize {
        self.succeeded.load(Ordering::SeqCst)
    }

    /// The keys whose events arrived since the last call (or since the
    /// watch began), for a caller that runs no open loop.
    pub fn arrived(&mut self) -> Vec<String> {
        let mut keys = Vec::new();
        while let Ok((key, _)) = self.arrivals.try_recv() {
            keys.push(key);
        }
        keys
    }

    /// Jobs that ended otherwise: none should.
    pub fn other(&self) -> usize {
        self.other.load(Ordering::SeqCst)
    }
}

/// What an open loop measured: each job's latency from its intent's due time
/// to its event, and how late the generator's publishes were confirmed (the
/// part of the latency the generator itself may add).
pub struct OpenLoop {
    pub latency: Percentiles,
    pub publish_lag: Percentiles,
    pub timings: Vec<Timing>,
}

/// Publishes at `rate` per second for `seconds` on a fixed schedule.
pub async fn open_loop(
    producer: Arc<Producer>,
    events: &mut Events,
    rate: f64,
    seconds: u64,
    prefix: &str,
) -> OpenLoop {
    let count = ((rate * seconds as f64) as usize).max(1);
    let lead = Duration::from_millis(100);
    let start = tokio::time::Instant::now() + lead;
    let wall = std::time::SystemTime::now() + lead;
    let offset = move |i: usize| Duration::from_secs_f64(i as f64 / rate);
    let due = move |i: usize| start + offset(i);
    let keys = prefix.to_owned();
    let generator = tokio::spawn(async move {
        let mut publishes = tokio::task::JoinSet::new();
        for i in 0..count {
            tokio::time::sleep_until(due(i)).await;
            let producer = producer.clone();
            let key = format!("{keys}{i}");
            publishes.spawn(async move {
                producer
                    .publish_only(&intent("bench", &key, "x"))
                    .await
                    .expect("latency publish confirmed");
                tokio::time::Instant::now().saturating_duration_since(due(i))
            });
        }
        let mut lags = Vec::with_capacity(count);
        while let Some(lag) = publishes.join_next().await {
            lags.push(lag.expect("a publish"));
        }
        lags
    });
    let mut seen = HashSet::with_capacity(count);
    let mut times = Vec::with_capacity(count);
    let mut timings = Vec::with_capacity(count);
    let progress = bar(count as u64, "latency, open loop");
    let limit = Duration::from_secs(seconds * 3 + 60);
    let epoch = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    while times.len() < count {
        assert_eq!(events.other(), 0, "a job ended otherwise than succeeded");
        let (key, at) = tokio::time::timeout(limit, events.arrivals.recv())
            .await
            .expect("latency events kept arriving")
            .expect("event watcher running");
        let Some(i) = key
            .strip_prefix(prefix)
            .and_then(|i| i.parse::<usize>().ok())
        else {
            continue;
        };
        if seen.insert(i) {
            let latency = at.saturating_duration_since(due(i).into_std());
            times.push(latency);
            timings.push(Timing {
                key,
                due: epoch(wall + offset(i)),
                arrived: epoch(wall + offset(i) + latency),
            });
            progress.inc(1);
        }
    }
    progress.finish_and_clear();
    let lags = generator.await.expect("generator");
    OpenLoop {
        latency: Percentiles::of(times),
        publish_lag: Percentiles::of(lags),
        timings,
    }
}

/// When a latency job's intent was due and when its event arrived, in seconds
/// since the epoch (the machine's one clock, which Postgres's `now()` reads too).
pub struct Timing {
    pub key: String,
    pub due: f64,
    pub arrived: f64,
}

/// Where the latency goes, from the database's timestamps (each the start of the
/// transaction that wrote it): due → admitted, admitted → started, started →
/// settling, settling → event arrived.
pub(super) async fn stages(env: &TestEnv, timings: &[Timing]) -> Vec<(String, Percentiles)> {
    let mut conn = PgConnection::connect(&env.database_url)
        .await
        .expect("connect to read the stages");
    let rows: Vec<(String, f64, f64, f64)> = sqlx::query_as(
        "SELECT j.idempotency_key, extract(epoch FROM j.created_at)::float8, \
                extract(epoch FROM a.started_at)::float8, extract(epoch FROM a.finished_at)::float8 \
         FROM jobs j JOIN attempts a ON a.job_id = j.id AND a.number = 1 \
         WHERE j.idempotency_key LIKE 'l-%' AND a.status = 'succeeded'",
    )
    .fetch_all(&mut conn)
    .await
    .expect("read the stages");
    conn.close().await.ok();
    let rows: std::collections::HashMap<String, (f64, f64, f64)> = rows
        .into_iter()
        .map(|(key, admitted, started, settling)| (key, (admitted, started, settling)))
        .collect();
    let mut stages: [Vec<Duration>; 4] = Default::default();
    let span = |from: f64, to: f64| Duration::from_secs_f64((to - from).max(0.0));
    for t in timings {
        if let Some(&(admitted, started, settling)) = rows.get(&t.key) {
            stages[0].push(span(t.due, admitted));
            stages[1].push(span(admitted, started));
            stages[2].push(span(started, settling));
            stages[3].push(span(settling, t.arrived));
        }
    }
    let names = [
        "due → admitted (intent hop, intake)",
        "admitted → started (commit, publish, hop, claim)",
        "started → settling (call, settle gathering)",
        "settling → event arrived (commit, publish, hop)",
    ];
    names
        .iter()
        .zip(stages)
        .map(|(name, samples)| ((*name).to_owned(), Percentiles::of(samples)))
        .collect()
}
