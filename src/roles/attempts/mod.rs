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
//! The rooms: `consumer` (slots, pauses), `claim`, `call`, `settle`.

mod call;
mod claim;
mod consumer;
mod settle;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use claim::claim;
use consumer::Consumer;
use settle::settle;
use tokio::sync::Semaphore;

use crate::broker;
use crate::provider::Client;
use crate::runtime::{self, Abandoned, Context, GroupCommit, Result, Stages, WorkerError};
use crate::shutdown::Shutdown;

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
    let worker = &ctx.config.worker;
    let (claimer, claims) = {
        let (ctx, shutdown, client) = (ctx.clone(), shutdown.clone(), client.clone());
        // A claim nobody waits for any more (its handler was cut off at the end of
        // the shutdown grace) is not made: it would start an attempt no one calls.
        GroupCommit::start(
            Stages {
                wait: "claim_wait",
                flush: "claim",
            },
            worker.batch_size,
            worker.flush_interval,
            Abandoned::Skip,
            move |ids| {
                let (ctx, shutdown, client) = (ctx.clone(), shutdown.clone(), client.clone());
                async move { claim(&ctx, &shutdown, &client, ids).await }
            },
        )
    };
    let (completer, settlements) = {
        let (ctx, shutdown, name) = (ctx.clone(), shutdown.clone(), provider.clone());
        // A settlement is written even when its handler is gone: the call was made.
        GroupCommit::start(
            Stages {
                wait: "settle_wait",
                flush: "settle",
            },
            worker.batch_size,
            worker.flush_interval,
            Abandoned::Flush,
            move |batch| {
                let (ctx, shutdown, name) = (ctx.clone(), shutdown.clone(), name.clone());
                async move { settle(&ctx, &shutdown, &name, batch).await }
            },
        )
    };
    let consumer = Consumer {
        ctx: ctx.clone(),
        shutdown: shutdown.clone(),
        client,
        queue: broker::attempts_queue(&provider),
        calls: Arc::new(Semaphore::new(concurrency)),
        claims,
        settlements,
    };
    let queue = consumer.queue.clone();
    let consumer = Arc::new(consumer);
    let outcome = runtime::consume(
        &ctx,
        &queue,
        worker.attempt_prefetch,
        &shutdown,
        |delivery| {
            let consumer = consumer.clone();
            async move { consumer.handle(delivery).await }
        },
    )
    .await;
    // The handlers are done or cut off: the group commits finish what they were
    // handed, then stop.
    drop(consumer);
    let _ = tokio::join!(claimer, completer);
    outcome
}
