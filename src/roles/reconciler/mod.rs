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
//!   ([`crate::store::Store::refresh_statistics`]).
//! - **Evidence**: an `unknown` attempt of a provider that keeps evidence is
//!   settled from it (a stored completion, or the answer to its request sent
//!   again with its key), or failed when there is none (`evidence`; one look
//!   is [`crate::shared::evidence`]).
//! - **Hedging**: for operations with `hedge_after`, a job whose attempt has been
//!   silent that long gets one parallel attempt on the next qualified provider.
//!
//! Several reconcilers may run at once: every pass claims rows with
//! `FOR UPDATE SKIP LOCKED` or goes through a guarded statement.

mod evidence;
mod handed_on;

use std::time::Duration;

use crate::domain::{self, GiveUp};
use crate::shared::policy::Planner;
use crate::shared::runtime::{Context, Result, WorkerError};
use crate::shared::shutdown::Shutdown;
use crate::store::{FailedJob, Settled};
use crate::trace::TraceContext;

/// Outbox rows one relay pass takes at most.
const RELAY_BATCH: i64 = 256;

/// How often the job pruner looks for ended jobs past their retention.
const PRUNE_EVERY: Duration = Duration::from_secs(10);
/// Jobs one pruning statement deletes at most.
const PRUNE_BATCH: i64 = 1000;
/// Batches one pruning pass runs at most, with a pause between them, so that a
/// large first prune spreads over several passes.
const PRUNE_BATCHES: usize = 100;

/// How often the dead rows of `turns` are looked at
/// ([`crate::store::Store::vacuum_turns_if_due`]).
const TURNS_VACUUM_EVERY: Duration = Duration::from_secs(1);

/// Runs every pass, and takes the settlements handed on, until shutdown. A
/// failure of the settlements' consumer stops the role as a pass's would.
pub(crate) async fn run(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let pruner = tokio::spawn(prune_loop(ctx.clone(), shutdown.clone()));
    let turns = tokio::spawn(vacuum_turns_loop(ctx.clone(), shutdown.clone()));
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

/// Prunes ended jobs past their retention every [`PRUNE_EVERY`] until shutdown.
async fn prune_loop(ctx: Context, shutdown: Shutdown) {
    let policy = crate::store::Policy::of(&ctx.config);
    loop {
        match prune_jobs(&ctx, &policy, &shutdown).await {
            Ok(p) if p.jobs > 0 => {
                tracing::info!(
                    jobs = p.jobs,
                    attempts = p.attempts,
                    "pruned ended jobs past their retention"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "pruning ended jobs failed; will retry"),
        }
        match ctx.store.prune_spend(10_000).await {
            Ok(n) if n > 0 => tracing::debug!(rows = n, "pruned owners' spend older than a day"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "pruning owners' spend failed; will retry"),
        }
        match ctx.store.vacuum_if_due().await {
            Ok(tables) => {
                for table in tables {
                    crate::shared::metrics::vacuumed(&table);
                    tracing::info!(%table, "vacuumed (the server runs no autovacuum)");
                }
            }
            Err(e) => tracing::warn!(error = %e, "vacuuming failed; will retry"),
        }
        tokio::select! {
            () = shutdown.wait() => return,
            () = tokio::time::sleep(PRUNE_EVERY) => {}
        }
    }
}

/// Vacuums `turns` when its dead rows are due, every [`TURNS_VACUUM_EVERY`],
/// until shutdown.
async fn vacuum_turns_loop(ctx: Context, shutdown: Shutdown) {
    let mut failing = false;
    loop {
        match ctx.store.vacuum_turns_if_due().await {
            Ok(vacuumed) => {
                if vacuumed {
                    crate::shared::metrics::vacuumed("turns");
                }
                failing = false;
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "vacuuming turns failed; will retry");
                }
                failing = true;
            }
        }
        tokio::select! {
            () = shutdown.wait() => return,
            () = tokio::time::sleep(TURNS_VACUUM_EVERY) => {}
        }
    }
}

/// One pruning pass: batches until one comes back short (or [`PRUNE_BATCHES`]).
pub(crate) async fn prune_jobs(
    ctx: &Context,
    policy: &crate::store::Policy,
    shutdown: &Shutdown,
) -> Result<crate::store::Pruned> {
    let pass = ctx
        .store
        .prune_batches(
            policy,
            PRUNE_BATCH,
            PRUNE_BATCHES,
            Duration::from_millis(10),
            || shutdown.is_triggered(),
        )
        .await?;
    crate::shared::metrics::oldest_prunable(pass.oldest);
    Ok(pass.pruned)
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
        if let Err(e) = relay_once(&ctx).await {
            tracing::warn!(error = %e, "outbox relay pass failed; will retry");
        }
        if last_sweep.elapsed() >= sweep_every {
            last_sweep = tokio::time::Instant::now();
            if let Err(e) = sweep_once(&ctx).await {
                tracing::warn!(error = %e, "reconciler sweep failed; will retry");
            }
            match ctx.store.refresh_statistics().await {
                Ok(tables) if !tables.is_empty() => {
                    tracing::debug!(?tables, "refreshed the planner's statistics")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "refreshing statistics failed; will retry"),
            }
            match prune_outbox(&ctx).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(rows = n, "pruned published outbox rows"),
                Err(e) => tracing::warn!(error = %e, "outbox pruning failed; will retry"),
            }
        }
        if last_scan.elapsed() >= ctx.config.worker.dead_letter_scan {
            last_scan = tokio::time::Instant::now();
            if let Err(e) = reflect_dead_intents(&ctx).await {
                tracing::warn!(error = %e, "admitting dead-lettered valid intents failed; will retry");
            }
            if let Err(e) = reflect_dead_letters(&ctx).await {
                tracing::warn!(error = %e, "dead-letter scan failed; will retry");
            }
        }
    }
}

/// One relay pass: claim due rows, publish them with confirms, mark them.
/// Returns how many rows it claimed.
pub(crate) async fn relay_once(ctx: &Context) -> Result<usize> {
    let mut total = 0;
    loop {
        let batch = ctx.store.claim_outbox(RELAY_BATCH).await?;
        if batch.is_empty() {
            return Ok(total);
        }
        total += batch.len();
        tracing::debug!(rows = batch.len(), "relaying outbox rows");
        ctx.publish_outbox(&batch).await?;
        if batch.len() < RELAY_BATCH as usize {
            return Ok(total);
        }
    }
}

/// One pass of the vanished-worker, lost-message and hedging checks.
pub(crate) async fn sweep_once(ctx: &Context) -> Result<()> {
    // Each pass on its own: one that fails (a row held past a lock timeout, say)
    // is logged and tried again next sweep, and never skips the passes after it.
    let passes = [
        ("vanished workers", vanished_once(ctx).await),
        ("kept answers", settle_kept_once(ctx).await),
        ("lost messages", lost_once(ctx).await),
        ("hedging", hedge_once(ctx).await),
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

/// Started attempts silent past their deadline plus the grace become `unknown`.
async fn vanished_once(ctx: &Context) -> Result<()> {
    let grace = ctx.config.worker.vanished_grace;
    for id in ctx.store.expire_vanished(grace).await? {
        tracing::warn!(attempt_id = %id, "worker vanished mid-call: attempt and job are now unknown");
    }
    Ok(())
}

/// Settles the answers that were kept on their attempts because their rows
/// were held when they arrived ([`crate::store::Store::keep_answer`]), or
/// because evidence found them: by the same settlement as a live answer, so a
/// job that ended meanwhile discards it with its usage kept. The settlement
/// clears each answer it settles. One whose rows are still held, or that
/// Postgres refused, is moved behind the others ([`KEPT_HELD_PAUSE`]), so
/// that answers the pass cannot settle never keep it from those it can.
pub(crate) async fn settle_kept_once(ctx: &Context) -> Result<()> {
    let kept = ctx.store.kept_answers(KEPT_BATCH).await?;
    if kept.is_empty() {
        return Ok(());
    }
    let planner = Planner::load_all(&ctx.config, &ctx.store).await?;
    let plan = |f: &FailedJob| planner.plan(f);
    let (settled, publish) = ctx.store.finalize(&kept, &plan).await?;
    let mut later = Vec::new();
    for (finished, settled) in kept.iter().zip(&settled) {
        match settled {
            Settled::Busy | Settled::Refused { .. } => later.push(finished.attempt_id),
            _ => {
                tracing::info!(attempt_id = %finished.attempt_id, job_id = %finished.job_id, ?settled, "a kept answer was settled")
            }
        }
    }
    ctx.store.kept_later(&later, KEPT_HELD_PAUSE).await?;
    ctx.publish_outbox(&publish).await?;
    Ok(())
}

/// Kept answers one pass settles at most.
const KEPT_BATCH: i64 = 100;
/// How long a kept answer whose rows were held waits before it is tried again.
const KEPT_HELD_PAUSE: Duration = Duration::from_secs(5);

/// Queued attempts whose message seems lost are republished, then failed.
async fn lost_once(ctx: &Context) -> Result<()> {
    let w = &ctx.config.worker;
    let max = i32::try_from(w.max_republish).unwrap_or(i32::MAX);
    let backlogged = backlogged(ctx).await;
    let (republish, lost) = ctx
        .store
        .stuck_queued(w.stuck_after, max, &backlogged)
        .await?;
    ctx.publish_outbox(&republish).await?;
    if !lost.is_empty() {
        let planner = Planner::load_all(&ctx.config, &ctx.store).await?;
        let plan = |f: &FailedJob| planner.plan(f);
        let error = format!(
            "attempt_lost: its message was republished {} times and the attempt never started",
            w.max_republish
        );
        let lost: Vec<_> = lost.into_iter().map(|a| (a, error.clone())).collect();
        let (_, publish) = ctx.store.fail_queued(&lost, true, &plan).await?;
        ctx.publish_outbox(&publish).await?;
    }
    unserved_once(ctx).await
}

/// Turns held for a provider this worker's configuration no longer has
/// (removed or renamed), for longer than `stuck_after`: only a consumer of a
/// turn's provider hands it out, so they would wait for ever. Each fails
/// `provider_not_served`, and its job moves on along its route (or fails, as
/// the route rule says).
async fn unserved_once(ctx: &Context) -> Result<()> {
    let served = ctx.config.provider_names();
    let unserved = ctx
        .store
        .unserved_turns(&served, ctx.config.worker.stuck_after, 100)
        .await?;
    if unserved.is_empty() {
        return Ok(());
    }
    let failures: Vec<(domain::AttemptId, String)> = unserved
        .into_iter()
        .map(|(attempt, provider)| {
            let why = format!(
                "provider_not_served: provider {provider:?} is not configured, and its turn was held past worker.stuck_after ({}); the route moves on",
                humantime::format_duration(ctx.config.worker.stuck_after)
            );
            tracing::warn!(attempt_id = %attempt, %provider, "a held turn's provider is not configured: its attempt fails and the route moves on");
            (attempt, why)
        })
        .collect();
    let planner = Planner::load_all(&ctx.config, &ctx.store).await?;
    let plan = |f: &FailedJob| planner.plan(f);
    let (_, publish) = ctx.store.fail_queued(&failures, true, &plan).await?;
    ctx.publish_outbox(&publish).await?;
    Ok(())
}

/// The providers whose attempts queue holds messages now. An attempt of theirs
/// that has not started may simply be waiting in that backlog, so the stuck
/// sweep leaves it alone until the queue has drained, or has moved past it
/// ([`crate::store::Store::stuck_queued`]).
async fn backlogged(ctx: &Context) -> Vec<String> {
    let mut out = Vec::new();
    for provider in ctx.config.providers.keys() {
        let queue = crate::broker::attempts_queue(provider);
        match crate::broker::depth(&ctx.connection, &queue).await {
            Ok(0) => {}
            Ok(_) => out.push(provider.clone()),
            // Not knowing, take it for backlogged: only what its queue has
            // moved past is taken this pass; the rest goes on.
            Err(e) => {
                tracing::warn!(%queue, error = %e, "cannot read the queue's depth");
                out.push(provider.clone());
            }
        }
    }
    out
}

/// Deletes published outbox rows past `outbox_retention`, a bounded batch at a
/// time, at most ten batches a pass, so that a large first prune does not hold up
/// the relay and the sweeps.
pub(crate) async fn prune_outbox(ctx: &Context) -> Result<u64> {
    const BATCH: i64 = 1000;
    let mut total = 0;
    for _ in 0..10 {
        let n = ctx
            .store
            .prune_outbox(ctx.config.worker.outbox_retention, BATCH)
            .await?;
        total += n;
        if n < BATCH as u64 {
            break;
        }
    }
    Ok(total)
}

/// Marks attempts whose messages died in their dead-letter queue while they were
/// still `queued`: `failed`, with the dead letter's reason, and plans the next
/// attempt. Browsing returns every dead letter to its queue.
pub(crate) async fn reflect_dead_letters(ctx: &Context) -> Result<()> {
    let mut dead = Vec::new();
    for provider in ctx.config.providers.keys() {
        let queue = crate::broker::dead_letter_queue(&crate::broker::attempts_queue(provider));
        crate::shared::dlq::visit(&ctx.connection, &queue, 256, |letter, delivery| {
            if let Ok(message) =
                serde_json::from_slice::<crate::domain::AttemptMessage>(&delivery.data)
            {
                dead.push((
                    message.attempt_id,
                    format!("dead_lettered: {} (see {queue})", letter.reason),
                ));
            }
        })
        .await?;
    }
    if dead.is_empty() {
        return Ok(());
    }
    let planner = Planner::load_all(&ctx.config, &ctx.store).await?;
    let plan = |f: &FailedJob| planner.plan(f);
    let (settled, publish) = ctx.store.fail_queued(&dead, true, &plan).await?;
    for (attempt, _) in &settled {
        tracing::warn!(attempt_id = %attempt, "attempt's message was dead-lettered: attempt marked failed");
    }
    ctx.publish_outbox(&publish).await?;
    Ok(())
}

/// Intents the broker dead-lettered for their delivery limit although they
/// are valid (workers died holding them more often than the limit allows:
/// RabbitMQ counts a delivery held by a dead consumer as returned) become jobs
/// all the same: each is admitted as intake would have, and its first attempt
/// published. A valid intent always ends as a job. The letter stays in
/// `onejob.intents.dlq`, as every dead letter does, for an operator to look
/// at; its identity's job answers a replay as a `duplicate`. Browsing returns
/// every dead letter to its queue.
pub(crate) async fn reflect_dead_intents(ctx: &Context) -> Result<()> {
    let queue = crate::broker::dead_letter_queue(crate::broker::INTENTS_QUEUE);
    let mut valid: Vec<crate::store::NewJob> = Vec::new();
    crate::shared::dlq::visit(&ctx.connection, &queue, 256, |letter, delivery| {
        if letter.reason == "delivery_limit"
            && let Ok(mut new) = crate::shared::runtime::new_job(&ctx.config, &delivery.data)
        {
            // The publisher's trace continues here as it would have at intake.
            let parent = TraceContext::from_headers(delivery.properties.headers().as_ref());
            new.trace = Some(TraceContext::child_or_root(parent.as_ref()));
            valid.push(new);
        }
    })
    .await?;
    if valid.is_empty() {
        return Ok(());
    }
    let admitted = ctx.store.admit(&valid).await?;
    let mut publish = Vec::new();
    for (new, admission) in valid.iter().zip(admitted) {
        if let crate::store::Admission::Created {
            job_id,
            publish: message,
        } = admission
        {
            tracing::warn!(%job_id, owner_id = %new.intent.owner_id, "a valid intent the broker dead-lettered for its delivery limit was admitted from {queue}");
            publish.extend(message);
        }
    }
    ctx.publish_outbox(&publish).await?;
    Ok(())
}

/// Starts at most one hedge per job whose attempt has been silent for its
/// operation's `hedge_after`, on the next qualified provider other than its own.
pub(crate) async fn hedge_once(ctx: &Context) -> Result<()> {
    let hedged: Vec<(String, Duration)> = ctx
        .config
        .operations
        .values()
        .filter_map(|o| o.hedge_after.map(|d| (o.name.clone(), d)))
        .collect();
    let candidates = ctx.store.hedge_candidates(&hedged).await?;
    if candidates.is_empty() {
        return Ok(());
    }
    let planner = Planner::load_all(&ctx.config, &ctx.store).await?;
    for candidate in candidates {
        let job = candidate.job_id;
        let (current, operation) = (candidate.provider.as_str(), candidate.operation.as_str());
        let Some(op) = ctx.config.operations.get(operation) else {
            continue;
        };
        let target = domain::next_provider(
            &op.route,
            |p| p != current && planner.is_eligible(operation, p),
            current,
            candidate.attempts_made,
            op.max_attempts,
        );
        match target {
            Ok(provider) => {
                if let Some(attempt) = ctx.store.hedge(job, provider).await? {
                    tracing::info!(job_id = %job, attempt_id = %attempt, %provider, "hedging: a parallel attempt takes its turn");
                }
            }
            Err(GiveUp::AttemptsSpent { .. } | GiveUp::NoEligibleProvider) => {
                tracing::debug!(job_id = %job, "no hedge: no other qualified provider, or attempts spent");
            }
        }
    }
    Ok(())
}
