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
//! One file per pass, each a [`pass::Pass`] run on a timer of its own
//! ([`pass::run`]), as River's maintenance services are: `relay`, `vanished`,
//! `kept`, `lost`, `unserved`, `hedge`, `statistics`, `prune_outbox`,
//! `prune_jobs`, `prune_spend`, `vacuum`, `vacuum_turns`, `dead_intents`,
//! `dead_attempts`, and `evidence` (one per provider that keeps evidence);
//! `handed_on` is a consumer. This one schedules them. Several reconcilers
//! may run at once: every pass claims rows with `FOR UPDATE SKIP LOCKED` or
//! goes through a guarded statement, and so may the passes of one.

pub mod dead_attempts;
pub mod dead_intents;
pub mod evidence;
mod handed_on;
pub mod hedge;
pub mod kept;
pub mod lost;
pub mod pass;
pub mod prune_jobs;
pub mod prune_outbox;
pub mod prune_spend;
pub mod relay;
pub mod statistics;
pub mod unserved;
pub mod vacuum;
pub mod vacuum_turns;
pub mod vanished;

use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::edges::shutdown::Shutdown;
use crate::shared::runtime::{Context, Result, WorkerError};

use pass::Pass;

/// Runs every pass, each on its own timer, and takes the settlements handed
/// on, until shutdown; then waits for the runs in progress. A failure of the
/// settlements' consumer, or a pass that panicked, stops the role.
pub(crate) async fn run(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let mut passes = schedule(&ctx, &shutdown);
    let mut handed_on = tokio::spawn(handed_on::consume(ctx.clone(), shutdown.clone()));
    let stopped = |e: String| WorkerError::RoleStopped("reconciler".into(), e);
    loop {
        tokio::select! {
            ended = &mut handed_on => {
                let outcome = match ended {
                    // At a stop the consumer hands back what it holds.
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(e),
                    Err(e) => Err(stopped(e.to_string())),
                };
                if outcome.is_err() {
                    passes.abort_all();
                }
                while passes.join_next().await.is_some() {}
                return outcome;
            }
            joined = passes.join_next(), if !passes.is_empty() => {
                // A pass's task ends at the stop, or by a panic.
                if let Some(Err(e)) = joined {
                    passes.abort_all();
                    handed_on.abort();
                    return Err(stopped(format!("a reconciler pass ended: {e}")));
                }
            }
        }
    }
}

/// Starts every pass on its own timer. The relay and the evidence passes
/// run free: the relay is what every delayed attempt waits for, and a look
/// for evidence can wait a whole provider timeout. The others share half the
/// pool's connections, so that passes held by a lock (a migration's, an
/// operator's `LOCK TABLE`) never take more than that from the console and
/// the gauges.
fn schedule(ctx: &Context, shutdown: &Shutdown) -> JoinSet<()> {
    let shared = (ctx.config.worker.pool_size / 2).max(1) as usize;
    let mut passes = Schedule {
        set: JoinSet::new(),
        ctx,
        shutdown,
        shared: Arc::new(Semaphore::new(shared)),
    };
    passes.free(relay::Relay);
    for evidence in evidence::Evidence::passes(&ctx.config) {
        passes.free(evidence);
    }
    passes.shared(vanished::Vanished);
    passes.shared(kept::Kept);
    passes.shared(lost::Lost);
    passes.shared(unserved::Unserved);
    passes.shared(hedge::Hedge);
    passes.shared(statistics::Statistics);
    passes.shared(prune_outbox::PruneOutbox);
    passes.shared(prune_jobs::PruneJobs);
    passes.shared(prune_spend::PruneSpend);
    passes.shared(vacuum::Vacuum);
    passes.shared(vacuum_turns::VacuumTurns);
    passes.shared(dead_intents::DeadIntents);
    passes.shared(dead_attempts::DeadAttempts);
    passes.set
}

/// The passes started so far, and what they are started with.
struct Schedule<'a> {
    set: JoinSet<()>,
    ctx: &'a Context,
    shutdown: &'a Shutdown,
    shared: Arc<Semaphore>,
}

impl Schedule<'_> {
    /// Starts `pass` with no limit but its timer.
    fn free(&mut self, pass: impl Pass) {
        let run = pass::run(pass, self.ctx.clone(), self.shutdown.clone(), None);
        self.set.spawn(run);
    }

    /// Starts `pass` with a share of the connections the passes may hold.
    fn shared(&mut self, pass: impl Pass) {
        let limit = Some(Arc::clone(&self.shared));
        let run = pass::run(pass, self.ctx.clone(), self.shutdown.clone(), limit);
        self.set.spawn(run);
    }
}
