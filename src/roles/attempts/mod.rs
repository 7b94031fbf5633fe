//! The attempt role: one consumer per provider, claiming and settling in
//! batches.
//!
//! Each delivery first takes one of the provider's call slots (`concurrency`),
//! so an attempt never waits for a slot once it has started. Then it is claimed
//! through the consumer's claim group commit: every delivery that got its slot
//! while the previous claim was committing is moved `queued → started` by one
//! guarded statement, which commits before any request leaves (a crash after
//! sending is then `unknown`). An attempt that does not start was a duplicate
//! delivery, is blocked behind an unknown (published again when the block
//! lifts), or names no attempt (dead-lettered). The started ones are called
//! concurrently, with the attempt id as `Idempotency-Key`, and each answer is
//! judged against the operation's output contract.
//!
//! Finished attempts are settled through the settle group commit, one
//! transaction per flush (up to `batch_size`, gathered for at most
//! `flush_interval` while another flush commits): still one compare-and-swap
//! per job, so two attempts of one job in the same flush have exactly one
//! winner, and a settlement Postgres refuses is settled apart from its
//! neighbours. A delivery is acked only after its settlement commits; the
//! outbox rows a flush wrote are published together, their confirms awaited
//! together, and marked published by one statement.
//!
//! Held first attempts are handed to the queue by `turns`, woken by the
//! claims and settlements that free their owners' places.
//!
//! A job this worker's own intake has just admitted is taken at once while a
//! call slot is free (`admitted`), its message's delivery dropped when it
//! comes.
//!
//! The rooms: `consumer` (slots, pauses), `admitted`, `claim`, `call`,
//! `settle`, `turns`.

mod admitted;
mod call;
mod claim;
mod consumer;
mod reserve;
mod settle;
mod taken;
#[cfg(test)]
mod tests;
mod turns;

use std::sync::Arc;

use claim::{Claimed, claim};
use consumer::Consumer;
use settle::{Committed, settle};
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;

use crate::domain::AttemptId;
use crate::edges::store::{Finished, Started};

use crate::broker;
use crate::edges::provider::Client;
use crate::edges::shutdown::Shutdown;
use crate::shared::runtime::{self, Abandoned, Context, GroupCommit, Result, Stages, WorkerError};

/// Runs the consumer for `provider` until shutdown.
pub(crate) async fn run(ctx: Context, provider: String, shutdown: Shutdown) -> Result<()> {
    let settings = ctx
        .config
        .providers
        .get(&provider)
        .cloned()
        .ok_or_else(|| WorkerError::UnknownProvider(provider.clone()))?;
    let client =
        Arc::new(Client::new(settings.clone()).map_err(|e| {
            WorkerError::RoleStopped(format!("attempts({provider})"), e.to_string())
        })?);
    let concurrency = usize::try_from(settings.concurrency)
        .unwrap_or(usize::MAX)
        .min(Semaphore::MAX_PERMITS);
    // Claims and settlements free turns: each wakes the hand-out.
    let freed = Arc::new(Notify::new());
    let share = Arc::new(turns::Share::new(settings.share()));
    let dispatcher = tokio::spawn(turns::hand_out(
        ctx.clone(),
        provider.clone(),
        share.clone(),
        freed.clone(),
        shutdown.clone(),
    ));
    let (claimer, claims) = claims(&ctx, &shutdown, &client, (&freed, &share));
    let (completer, settlements) = settlements(&ctx, &shutdown, &provider, &freed);
    let consumer = Consumer {
        ctx: ctx.clone(),
        shutdown: shutdown.clone(),
        client,
        queue: broker::attempts_queue(&provider),
        calls: Arc::new(Semaphore::new(concurrency)),
        claims,
        settlements,
        taken: taken::Taken::default(),
        local: std::sync::Mutex::new(tokio::task::JoinSet::new()),
    };
    let consumer = Arc::new(consumer);
    let outcome = consume(&ctx, &consumer, &provider, &shutdown).await;
    // The handlers are done or cut off, and so are the attempts taken on
    // admission: the group commits finish what they were handed, then stop.
    drop(consumer);
    // A hand-out cut off mid-way rolls back: its turns stay held.
    dispatcher.abort();
    let _ = tokio::join!(claimer, completer);
    outcome
}

/// Consumes the provider's queue, and takes the attempts this worker's
/// intake admits while a call slot is free, until shutdown or the consumer's
/// end. The attempts taken on admission finish within the grace, beside the
/// deliveries: from the stop, or from the consumer's end.
async fn consume(
    ctx: &Context,
    consumer: &Arc<Consumer>,
    provider: &str,
    shutdown: &Shutdown,
) -> Result<()> {
    let taking = consumer.clone();
    let registered = ctx.own_consumers.register(
        &broker::attempts_routing_key(provider),
        Arc::new(move |attempt, parent| taking.take_admitted(attempt, parent)),
    );
    let (consumed, consumer_done) = tokio::sync::oneshot::channel::<()>();
    let consuming = async {
        let outcome = runtime::consume(
            ctx,
            &consumer.queue,
            ctx.config.worker.attempt_prefetch,
            shutdown,
            |delivery| {
                let consumer = consumer.clone();
                async move { consumer.handle(delivery).await }
            },
        )
        .await;
        let _ = consumed.send(());
        outcome
    };
    let finishing = async {
        tokio::select! {
            () = shutdown.wait() => {}
            _ = consumer_done => {}
        }
        drop(registered);
        consumer
            .finish_admitted(ctx.config.worker.shutdown_grace)
            .await;
    };
    let (outcome, ()) = tokio::join!(consuming, finishing);
    outcome
}

/// The claim group commit; each flush counts the attempts it started into
/// the share's pace, and wakes the hand-out (`freed`).
fn claims(
    ctx: &Context,
    shutdown: &Shutdown,
    client: &Arc<Client>,
    (freed, share): (&Arc<Notify>, &Arc<turns::Share>),
) -> (JoinHandle<()>, GroupCommit<AttemptId, Claimed>) {
    let (ctx, shutdown, client) = (ctx.clone(), shutdown.clone(), client.clone());
    let (freed, share) = (freed.clone(), share.clone());
    let worker = &ctx.config.worker;
    // A claim nobody waits for any more (its handler was cut off at the end of
    // the shutdown grace) is not made: it would start an attempt no one calls;
    // one cut off while its flush ran is handed back once it has committed.
    GroupCommit::start(
        Stages {
            wait: "claim_wait",
            flush: "claim",
        },
        worker.batch_size,
        worker.flush_interval,
        (Abandoned::Skip, Some(claim::hand_back(&ctx))),
        move |ids| {
            let (ctx, shutdown, client) = (ctx.clone(), shutdown.clone(), client.clone());
            let (freed, share) = (freed.clone(), share.clone());
            async move {
                let claimed = claim(&ctx, &shutdown, &client, ids).await;
                let started = claimed
                    .iter()
                    .filter(|c| matches!(c, Ok(claim::ClaimAnswer::Started(..))))
                    .count();
                share
                    .started
                    .fetch_add(started as u64, std::sync::atomic::Ordering::Relaxed);
                freed.notify_one();
                claimed
            }
        },
    )
}

/// The settle group commit; each flush wakes the hand-out (`freed`).
fn settlements(
    ctx: &Context,
    shutdown: &Shutdown,
    provider: &str,
    freed: &Arc<Notify>,
) -> (JoinHandle<()>, GroupCommit<(Started, Finished), Committed>) {
    let (ctx, shutdown, name, freed) = (
        ctx.clone(),
        shutdown.clone(),
        provider.to_owned(),
        freed.clone(),
    );
    let worker = &ctx.config.worker;
    // A settlement is written even when its handler is gone: the call was made.
    GroupCommit::start(
        Stages {
            wait: "settle_wait",
            flush: "settle",
        },
        worker.batch_size,
        worker.flush_interval,
        (Abandoned::Flush, None),
        move |batch| {
            let (ctx, shutdown, name) = (ctx.clone(), shutdown.clone(), name.clone());
            let freed = freed.clone();
            async move {
                let settled = settle(&ctx, &shutdown, &name, batch).await;
                freed.notify_one();
                settled
            }
        },
    )
}
