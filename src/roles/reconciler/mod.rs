//! The reconciler role: what no single delivery would ever do by itself.
//!
//! - **Relay**: publishes outbox rows that are due and whose publisher's lease ran
//!   out (the publisher crashed, or the broker was down), and the delayed attempts
//!   that follow a failure once their backoff is over.
//! - **Vanished workers**: `started` attempts silent past their deadline plus a
//!   grace period become `unknown` (never `failed` by time alone: the provider may
//!   still be working).
//! - **Kept answers**: an answer whose rows were held under someone else's lock
//!   when it arrived was kept on its attempt; it is settled here, as a live
//!   answer would be.
//! - **Settlements handed on**: an answer a stopping worker could neither
//!   settle nor keep (Postgres unreachable) arrives on `onejob.settlements`;
//!   one that proves its claim is kept on its attempt, and settled as a kept
//!   answer (`handed_on`).
//! - **Lost messages**: `queued` attempts that never started long after their
//!   message was published are republished, then failed with a reason after
//!   `max_republish` tries.
//! - **Dead-lettered valid intents**: an intent the broker dead-lettered for its
//!   delivery limit although it is valid becomes a job all the same; the letter
//!   stays for an operator.
//! - **Dead-lettered attempts**: an attempt whose message died in its
//!   dead-letter queue (the delivery limit, say) while the attempt was still
//!   `queued` is marked `failed` with the dead letter's reason, and the route rule
//!   plans what follows. The dead letter itself stays for an operator.
//! - **Pruning**: published outbox rows past `outbox_retention` are deleted;
//!   ended jobs past their retention are deleted with their attempts, in a loop
//!   of its own so that a large backlog of them never holds up the relay.
//! - **Turns**: `turns` is vacuumed whenever its dead rows pass autovacuum's
//!   threshold, every second, whether or not autovacuum runs: every job
//!   churns a row of it, and its readers walk the dead index entries.
//! - **Statistics**: the busy tables are analyzed when their statistics are
//!   missing or far behind, as on a fresh database taking a backlog
//!   ([`crate::edges::store::Sweeps::refresh_statistics`]).
//! - **Evidence**: an `unknown` attempt of a provider that keeps evidence is
//!   settled from it (a stored completion, or the answer to its request sent
//!   again with its key), or failed when there is none (`evidence`; one look
//!   is [`crate::shared::evidence`]).
//! - **Hedging**: for operations with `hedge_after`, a job whose attempt has been
//!   silent that long gets one parallel attempt on the next qualified provider.
//!
//! One file per pass (`relay`, `vanished`, `kept`, `handed_on`, `lost`,
//! `unserved`, `dead_letters`, `prune`, `vacuum_turns`, `evidence`,
//! `hedge`); this one schedules them. Several reconcilers may run at once:
//! every pass claims rows with `FOR UPDATE SKIP LOCKED` or goes through a
//! guarded statement.

mod dead_letters;
mod evidence;
mod handed_on;
mod hedge;
mod kept;
mod lost;
mod prune;
mod relay;
mod unserved;
mod vacuum_turns;
mod vanished;

use std::time::Duration;

use crate::edges::shutdown::Shutdown;
use crate::shared::runtime::{Context, Result, WorkerError};

/// Runs every pass, and takes the settlements handed on, until shutdown. A
/// failure of the settlements' consumer stops the role as a pass's would.
pub(crate) async fn run(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let pruner = tokio::spawn(prune::prune_loop(ctx.clone(), shutdown.clone()));
    let turns = tokio::spawn(vacuum_turns::vacuum_turns_loop(
        ctx.clone(),
        shutdown.clone(),
    ));
    let evidence = tokio::spawn(evidence::evidence_loop(ctx.clone(), shutdown.clone()));
    let mut handed_on = tokio::spawn(handed_on::consume(ctx.clone(), shutdown.clone()));
    let passes = passes(ctx, shutdown.clone());
    tokio::pin!(passes);
    let outcome = tokio::select! {
        outcome = &mut passes => {
            // At a stop the consumer hands back what it holds; otherwise it
            // is stopped with the passes.
            if !shutdown.is_triggered() {
                handed_on.abort();
            }
            let _ = handed_on.await;
            outcome
        }
        ended = &mut handed_on => match ended {
            Ok(Ok(())) => passes.await,
            Ok(Err(e)) => Err(e),
            Err(e) => Err(WorkerError::RoleStopped("reconciler".into(), e.to_string())),
        },
    };
    for task in [pruner, turns, evidence] {
        task.abort();
        let _ = task.await;
    }
    outcome
}

/// The relay, the sweeps and the dead-letter scan, until shutdown.
async fn passes(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let mut tick = tokio::time::interval(ctx.config.worker.relay_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sweep_every =
        Duration::from_secs(1).min(ctx.config.worker.relay_interval.saturating_mul(4));
    let mut last_sweep = tokio::time::Instant::now();
    let mut last_scan = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = shutdown.wait() => return Ok(()),
            _ = tick.tick() => {}
        }
        if let Err(e) = relay::relay_once(&ctx).await {
            tracing::warn!(error = %e, "outbox relay pass failed; will retry");
        }
        if last_sweep.elapsed() >= sweep_every {
            last_sweep = tokio::time::Instant::now();
            if let Err(e) = sweep_once(&ctx).await {
                tracing::warn!(error = %e, "reconciler sweep failed; will retry");
            }
            match ctx.store.sweeps().refresh_statistics().await {
                Ok(tables) if !tables.is_empty() => {
                    tracing::debug!(?tables, "refreshed the planner's statistics")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "refreshing statistics failed; will retry"),
            }
            match prune::prune_outbox(&ctx).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(rows = n, "pruned published outbox rows"),
                Err(e) => tracing::warn!(error = %e, "outbox pruning failed; will retry"),
            }
        }
        if last_scan.elapsed() >= ctx.config.worker.dead_letter_scan {
            last_scan = tokio::time::Instant::now();
            if let Err(e) = dead_letters::reflect_dead_intents(&ctx).await {
                tracing::warn!(error = %e, "admitting dead-lettered valid intents failed; will retry");
            }
            if let Err(e) = dead_letters::reflect_dead_letters(&ctx).await {
                tracing::warn!(error = %e, "dead-letter scan failed; will retry");
            }
        }
    }
}

/// One pass of the vanished-worker, lost-message and hedging checks.
pub(super) async fn sweep_once(ctx: &Context) -> Result<()> {
    // Each pass on its own: one that fails (a row held past a lock timeout, say)
    // is logged and tried again next sweep, and never skips the passes after it.
    let passes = [
        ("vanished workers", vanished::vanished_once(ctx).await),
        ("kept answers", kept::settle_kept_once(ctx).await),
        ("lost messages", lost::lost_once(ctx).await),
        ("hedging", hedge::hedge_once(ctx).await),
    ];
    let mut first = None;
    for (pass, outcome) in passes {
        if let Err(e) = outcome {
            tracing::warn!(%pass, error = %e, "reconciler pass failed; will retry");
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}
