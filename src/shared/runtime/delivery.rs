//! Acking, requeueing, and retries that wait out a dependency's outage
//! (until shutdown) but give up on other failures after a few tries.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};

use super::{Result, WorkerError};
use crate::edges::shutdown::Shutdown;

/// Acks a delivery, treating a closed channel as an error (lapin returns
/// `Ok(false)` then, and the broker will redeliver).
pub async fn ack(delivery: &Delivery) -> Result<()> {
    if !delivery.acker.ack(BasicAckOptions::default()).await? {
        tracing::warn!(
            delivery_tag = delivery.delivery_tag,
            "ack not sent: channel closed; the broker will redeliver"
        );
    }
    Ok(())
}

/// Returns a delivery to its queue for another try.
pub async fn requeue(delivery: &Delivery) {
    let options = BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    };
    match delivery.acker.nack(options).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!("nack not sent: channel closed; the broker will redeliver"),
        Err(e) => tracing::warn!(error = %e, "nack failed; the broker will redeliver"),
    }
}

/// Retries `f` with backoff. While a dependency is unreachable it waits for as
/// long as the outage lasts: the delivery being worked on stays with this worker,
/// unacked, so an outage never counts against its delivery limit (contract
/// section 2), and `/readyz` says the worker is not ready meanwhile. When
/// `shutdown` is given it stops waiting at once, so the caller can hand the
/// delivery back without delay. Other failures are retried about fifteen times
/// (a minute or so); data Postgres refuses is not retried at all.
pub async fn with_retries<T, F, Fut>(shutdown: &Shutdown, what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    const OTHER_FAILURES: u32 = 15;
    let mut delays = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build();
    let mut failures = 0;
    loop {
        let error = match f().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let unavailable = error.is_unavailable();
        if !unavailable {
            failures += 1;
        }
        if shutdown.is_triggered()
            || failures > OTHER_FAILURES
            || matches!(&error, WorkerError::Store(s) if s.is_data_error())
        {
            return Err(error);
        }
        let delay = delays.next().unwrap_or(Duration::from_secs(5));
        if unavailable {
            tracing::warn!(error = %error, retry_in = ?delay, "{what}: a dependency is unreachable; holding the work and waiting");
        } else {
            tracing::warn!(error = %error, retry_in = ?delay, "{what} failed; retrying");
        }
        tokio::select! {
            () = shutdown.wait() => return Err(error),
            () = tokio::time::sleep(delay) => {}
        }
    }
}
