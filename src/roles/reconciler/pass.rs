//! A maintenance pass, as River's maintenance services are: a name, how often
//! it runs, and one run of it; and the loop that runs one on a timer of its
//! own until shutdown, so that a pass that is slow or held (a table locked by
//! a migration, a listing that does not answer) holds up no other.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::edges::shutdown::Shutdown;
use crate::settings::config::Config;
use crate::shared::runtime::{Context, Result};

/// One maintenance pass.
pub trait Pass: Send + Sync + 'static {
    /// Its name, in logs and in the `pass` label of its metrics.
    fn name(&self) -> &'static str;

    /// What it works on when several passes share a name (an evidence pass's
    /// provider), for its log lines.
    fn subject(&self) -> Option<&str> {
        None
    }

    /// How long from the start of one run to the start of the next, by the
    /// configuration (a run that takes longer delays the next, never doubles
    /// it up).
    fn every(&self, config: &Config) -> Duration;

    /// One run: what it found and did, as a count of the rows, messages or
    /// tables it acted on (0: nothing was due). A run checks `shutdown`
    /// between steps when it can be long.
    fn once(&self, ctx: &Context, shutdown: &Shutdown) -> impl Future<Output = Result<u64>> + Send;
}

/// The sweeps' period: every second, or four relay intervals when those are
/// shorter (a test's fast configuration).
pub fn sweep_every(config: &Config) -> Duration {
    Duration::from_secs(1).min(config.worker.relay_interval.saturating_mul(4))
}

/// Runs `pass` every [`Pass::every`] until shutdown. A run in progress when
/// the shutdown comes has `worker.shutdown_grace` to finish ([`finished`]). With `limit`, a run first takes one of its permits, so that
/// passes held by a lock never hold more of the pool's connections than it
/// has. A failed run is logged (once while it keeps failing, and again when
/// it recovers) and tried again at the next tick; the pass never stops.
pub async fn run(pass: impl Pass, ctx: Context, shutdown: Shutdown, limit: Option<Arc<Semaphore>>) {
    let name = pass.name();
    let subject = pass.subject().unwrap_or("").to_owned();
    let mut tick = tokio::time::interval(pass.every(&ctx.config));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            () = shutdown.wait() => return,
            _ = tick.tick() => {}
        }
        let _permit = match &limit {
            None => None,
            Some(limit) => tokio::select! {
                () = shutdown.wait() => return,
                permit = Arc::clone(limit).acquire_owned() => permit.ok(),
            },
        };
        let began = Instant::now();
        let Some(outcome) = finished(&pass, &ctx, &shutdown).await else {
            return;
        };
        crate::edges::metrics::reconciler_run(name, outcome.is_ok(), began.elapsed());
        ctx.pass_runs.ended(name);
        match outcome {
            Ok(done) => {
                if failing {
                    tracing::info!(pass = name, %subject, "reconciler pass recovered");
                }
                failing = false;
                if done > 0 {
                    tracing::debug!(pass = name, %subject, done, "reconciler pass ran");
                }
            }
            Err(e) => {
                if failing {
                    tracing::debug!(pass = name, %subject, error = %e, "reconciler pass failed again");
                } else {
                    tracing::warn!(pass = name, %subject, error = %e, "reconciler pass failed; will retry");
                }
                failing = true;
            }
        }
    }
}

/// One run of `pass`. When the shutdown comes mid-run, the run has
/// `worker.shutdown_grace` to end (a long one checks the shutdown itself);
/// one still going then (a statement waiting on a lock held elsewhere) is
/// dropped, its transaction rolled back with its connection, and `None`
/// says so. What a dropped run had not done is found by the next run, here
/// or in another pod, as after a crash.
async fn finished(pass: &impl Pass, ctx: &Context, shutdown: &Shutdown) -> Option<Result<u64>> {
    let run = pass.once(ctx, shutdown);
    tokio::pin!(run);
    tokio::select! {
        outcome = &mut run => Some(outcome),
        () = shutdown.wait() => {
            let grace = ctx.config.worker.shutdown_grace;
            let outcome = tokio::time::timeout(grace, &mut run).await.ok();
            if outcome.is_none() {
                tracing::warn!(pass = pass.name(), "a reconciler pass was still running when the shutdown grace ran out; it is left for the next run");
            }
            outcome
        }
    }
}
