//! The failover phase: the synchronous cluster's primary crashed while
//! intents flow at 100/s, and what the intents' latencies and the new
//! primary's first commits say about it.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::{Connection, PgConnection};

use super::Options;
use super::site::Site;
use crate::drain::{Percentiles, Timing, open_loop, say};
use crate::pg_ha::OwnHa;

/// The load through the failover.
const RATE: f64 = 100.0;

/// What the failover measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Failover {
    pub rate_per_s: f64,
    pub intents: usize,
    /// From the crash to the first transaction that wrote through HAProxy.
    pub crash_to_first_write_s: f64,
    /// From the crash to the start of the first transaction that admitted a
    /// job on the new primary.
    pub crash_to_first_admission_s: f64,
    /// Intents whose event came more than a second after they were due.
    pub delayed_past_1s: usize,
    /// Due → event of the intents due before the crash, from it until the
    /// first write through HAProxy, and after.
    pub before: Percentiles,
    pub during: Percentiles,
    pub after: Percentiles,
    pub max_ms: f64,
}

/// Runs the open loop, crashes the primary's machine a quarter into it, and
/// measures.
pub async fn failover(site: &mut Site, options: &Options) -> Failover {
    let ha = site
        .ha
        .as_ref()
        .expect("the failover phase runs on a cluster");
    let probe_url = format!("{}/{}", ha.base_url(), site.env.name);
    say(&format!(
        "failover: {RATE:.0} intents/s for {} s, the primary crashed {} s in",
        options.failover_seconds,
        options.failover_seconds / 4
    ));
    let lead = Duration::from_secs(options.failover_seconds / 4);
    let (measured, (crashed_at, first_write)) = tokio::join!(
        open_loop(
            site.producer.clone(),
            &mut site.events,
            RATE,
            options.failover_seconds,
            "f-",
        ),
        crash_and_probe(ha, &probe_url, lead),
    );
    let first_admission = first_admission(&site.env.database_url, crashed_at).await;
    let windows = windows(&measured.timings, crashed_at, first_write);
    let latencies: Vec<f64> = measured.timings.iter().map(latency_s).collect();
    Failover {
        rate_per_s: RATE,
        intents: measured.timings.len(),
        crash_to_first_write_s: first_write,
        crash_to_first_admission_s: first_admission,
        delayed_past_1s: latencies.iter().filter(|l| **l > 1.0).count(),
        before: windows[0].clone(),
        during: windows[1].clone(),
        after: windows[2].clone(),
        max_ms: latencies.iter().copied().fold(0.0, f64::max) * 1000.0,
    }
}

fn latency_s(t: &Timing) -> f64 {
    (t.arrived - t.due).max(0.0)
}

/// The latencies of the intents due before the crash, from it until the
/// first write through HAProxy, and after.
fn windows(timings: &[Timing], crashed_at: f64, first_write: f64) -> [Percentiles; 3] {
    let mut split: [Vec<Duration>; 3] = Default::default();
    for t in timings {
        let window = if t.due < crashed_at {
            0
        } else if t.due <= crashed_at + first_write {
            1
        } else {
            2
        };
        split[window].push(Duration::from_secs_f64(latency_s(t)));
    }
    split.map(Percentiles::of)
}

/// Waits `lead`, crashes the primary's machine (its Patroni and PostgreSQL
/// SIGKILLed at once), then probes through HAProxy every 20 ms until a write
/// commits: when the crash was done (seconds since the epoch), and how long
/// after it that first write was.
async fn crash_and_probe(ha: &OwnHa, url: &str, lead: Duration) -> (f64, f64) {
    tokio::time::sleep(lead).await;
    let old = ha.primary();
    ha.script(&["crash", &old.to_string()]);
    // Taken once the kill is done: a transaction that began after this
    // cannot have committed on the old primary.
    let crashed_at = epoch_now();
    let crashed = Instant::now();
    loop {
        assert!(
            crashed.elapsed() < Duration::from_secs(120),
            "no write went through HAProxy within two minutes of the crash"
        );
        if writes(url).await {
            return (crashed_at, crashed.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether a transaction that takes a transaction id (which a standby
/// refuses) commits through `url` within a second.
async fn writes(url: &str) -> bool {
    let attempt = async {
        let mut conn = PgConnection::connect(url).await.ok()?;
        let wrote = sqlx::query("SELECT txid_current()")
            .execute(&mut conn)
            .await
            .is_ok();
        conn.close().await.ok();
        wrote.then_some(())
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Some(()))
    )
}

fn epoch_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// From the crash to the start of the first transaction that admitted a job
/// afterwards (on the new primary: the old one took none after its crash).
async fn first_admission(database_url: &str, crashed_at: f64) -> f64 {
    let mut conn = PgConnection::connect(database_url)
        .await
        .expect("connect to read the first admission");
    let first: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM min(created_at))::float8 FROM jobs WHERE created_at > to_timestamp($1)",
    )
    .bind(crashed_at)
    .fetch_one(&mut conn)
    .await
    .expect("read the first admission");
    conn.close().await.ok();
    first.map_or(f64::NAN, |t| t - crashed_at)
}
