//! The intake role: intents in, jobs out.
//!
//! Deliveries are taken in batches: all that are ready at once, up to the
//! worker's `batch_size`, so a busy intake admits many intents with one statement while a
//! lone intent never waits for company. Each intent is validated strictly,
//! fingerprinted, and admitted through the store's `INSERT … ON CONFLICT DO
//! NOTHING` (two intents with one identity in the same batch come out as
//! `created` and `duplicate`, as they would apart). Then, in this order: the first
//! attempts are published (confirmed), the receipts are sent, and the deliveries
//! are acked. A bad intent is copied to `onejob.intents.dlq` with its reason and
//! gets a `rejected` receipt. A crash anywhere means a redelivery, which comes out
//! as a `duplicate` naming the same job. A valid intent at its queue's delivery
//! limit is first handed on as a fresh copy, so that workers dying while they
//! hold it never get it dead-lettered ([`hand_on_if_at_limit`]).

use futures_util::future::join_all;
use lapin::message::Delivery;

use crate::broker::{self, INTENTS_QUEUE};
use crate::edges::shutdown::Shutdown;
use crate::edges::store::{Admission, NewJob};
use crate::intent::{Outcome, Receipt, RejectReason};
use crate::shared::runtime::{self, Context, Result, WorkerError, with_retries};
use crate::trace::TraceContext;

/// Batches settled at once; more deliveries wait and make the next batch larger.
const BATCHES_IN_FLIGHT: usize = 4;

/// Runs intake until shutdown.
pub async fn run(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let prefetch = ctx.config.worker.intake_prefetch;
    let batching = runtime::Batching {
        max_batch: ctx.config.worker.batch_size,
        max_in_flight: BATCHES_IN_FLIGHT,
    };
    runtime::consume_batches(
        &ctx,
        INTENTS_QUEUE,
        prefetch,
        batching,
        &shutdown,
        |delivery| arrive(&ctx, &shutdown, delivery),
        |batch| {
            let ctx = ctx.clone();
            let shutdown = shutdown.clone();
            async move { handle(&ctx, &shutdown, batch).await }
        },
    )
    .await
}

/// Validates an intent body against the contract and the configuration.
pub fn validate(ctx: &Context, body: &[u8]) -> Result<NewJob, RejectReason> {
    runtime::new_job(&ctx.config, body)
}

/// Settles a batch of deliveries: the invalid ones are dead-lettered with their
/// reason, the valid ones admitted by one statement, the first attempts of the
/// new jobs published together; then each delivery gets its receipt and its ack.
/// Whatever fails returns its deliveries to the queue, and their redelivery comes
/// out as a `duplicate` of the same job.
async fn handle(ctx: &Context, shutdown: &Shutdown, batch: Vec<Delivery>) {
    crate::edges::metrics::intake_batch(batch.len());
    let mut valid = Vec::with_capacity(batch.len());
    let mut rejected = Vec::new();
    // Each intent's span lasts until its batch is answered.
    let mut spans = Vec::new();
    for delivery in batch {
        match validate(ctx, &delivery.data)
            .and_then(|new_job| refused_reply_to(ctx, &delivery).map_or(Ok(new_job), Err))
        {
            Ok(mut new_job) => {
                let (span, trace) = intake_span(&delivery, &new_job);
                new_job.trace = Some(trace);
                spans.push(span);
                valid.push((delivery, new_job));
            }
            Err(reason) => rejected.push((delivery, reason)),
        }
    }
    let rejections = join_all(
        rejected
            .into_iter()
            .map(|(delivery, reason)| reject(ctx, shutdown, delivery, reason)),
    );
    let admissions = admit(ctx, shutdown, valid);
    let (rejections, admissions) = tokio::join!(rejections, admissions);
    let answered = rejections.into_iter().chain(admissions);
    let answers = join_all(answered.map(|(delivery, receipt)| async move {
        let Some(receipt) = receipt else {
            runtime::requeue(&delivery).await;
            return;
        };
        let answered = async {
            send_receipt(ctx, shutdown, &delivery, &receipt).await?;
            runtime::ack(&delivery).await
        };
        match answered.await {
            Ok(()) => crate::edges::metrics::intent(receipt.outcome),
            Err(e) => {
                tracing::error!(error = %e, "intent not settled; returning it to the queue");
                runtime::requeue(&delivery).await;
            }
        }
    }));
    crate::edges::metrics::timed("intake_answer", answers).await;
    drop(spans);
}

/// The intake's span for a valid intent, and the trace context its job keeps:
/// the publisher's `traceparent` continues, and without one a trace starts
/// here. The span is kept only when spans are exported.
fn intake_span(delivery: &Delivery, new_job: &NewJob) -> (tracing::Span, TraceContext) {
    let parent = TraceContext::from_headers(delivery.properties.headers().as_ref());
    crate::edges::telemetry::hop(parent.as_ref(), || {
        tracing::info_span!(
            "intake",
            otel.kind = "consumer",
            // The id the job gets if this intent creates it (a duplicate's
            // job keeps the id its first intent gave it).
            new_job_id = %new_job.job_id,
            owner_id = %new_job.intent.owner_id,
            operation = %new_job.intent.operation,
        )
    })
}

/// How many fresh copies of one valid intent are made at most. A valid intent
/// never crashes a worker, so this bounds only what a bug could make of it.
pub const MAX_HANDED_ON: u32 = 16;

/// A valid intent at its queue's delivery limit is handed on the moment it
/// arrives, not when a batch slot frees up (those may all wait for Postgres
/// meanwhile): [`hand_on_if_at_limit`]. Every other delivery waits for its batch.
fn arrive(ctx: &Context, shutdown: &Shutdown, delivery: Delivery) -> runtime::Arrival {
    if handed_on_so_far(ctx, &delivery).is_none() || validate(ctx, &delivery.data).is_err() {
        return runtime::Arrival::Batch(delivery);
    }
    let (ctx, shutdown) = (ctx.clone(), shutdown.clone());
    runtime::Arrival::Aside(Box::pin(async move {
        if !hand_on_if_at_limit(&ctx, &shutdown, &delivery).await {
            handle(&ctx, &shutdown, vec![delivery]).await;
        }
    }))
}

/// How many copies of this intent were handed on so far, when its delivery is
/// at the queue's delivery limit and another copy may be made; `None` otherwise.
fn handed_on_so_far(ctx: &Context, delivery: &Delivery) -> Option<u32> {
    let limit = u64::from(ctx.config.worker.delivery_limit);
    let headers = delivery.properties.headers().clone().unwrap_or_default();
    let count = |name: &str| broker::header_count(&headers, name);
    let handed_on = u32::try_from(count(runtime::HANDED_ON_HEADER)).unwrap_or(u32::MAX);
    (limit > 0 && count("x-delivery-count") >= limit && handed_on < MAX_HANDED_ON)
        .then_some(handed_on)
}

/// A valid intent whose delivery is at the queue's delivery limit would be
/// dead-lettered by the broker if it came back once more, and RabbitMQ counts
/// a delivery held by a worker that died (SIGKILL, a lost connection) as one
/// that came back, though nothing is wrong with the intent. So before any work
/// on it, such a delivery is handed on: a fresh copy (its delivery count left
/// behind) is published to the intents queue, confirmed, and this one acked.
/// The copy is admitted as the original would have been, receipt included.
/// Intake hands on only valid intents (an invalid one is dead-lettered with
/// its reason), and none already handed on [`MAX_HANDED_ON`] times. Whether it was
/// handed on; when the copy cannot be published, the original is worked on.
pub async fn hand_on_if_at_limit(ctx: &Context, shutdown: &Shutdown, delivery: &Delivery) -> bool {
    let Some(handed_on) = handed_on_so_far(ctx, delivery) else {
        return false;
    };
    // The publishing channel may be healing (the broker just came back, and a
    // burst of deliveries at their limit with it): wait for it, rather than
    // hold the delivery through a whole admission.
    let handed = with_retries(
        shutdown,
        "handing on an intent at its delivery limit",
        || ctx.hand_on_intent(delivery, handed_on + 1),
    )
    .await;
    if let Err(e) = handed {
        tracing::warn!(error = %e, "an intent at its delivery limit could not be handed on; working on it as it is");
        return false;
    }
    tracing::info!(message_id = ?delivery.properties.message_id(), handed_on = handed_on + 1, "an intent at its delivery limit was handed on as a fresh copy");
    crate::edges::metrics::intent_handed_on();
    if let Err(e) = runtime::ack(delivery).await {
        tracing::warn!(error = %e, "the original of an intent handed on was not acked; its copy stands");
    }
    true
}

/// Copies an invalid intent to the dead-letter queue with its reason; its
/// receipt, or `None` if the copy could not be made.
async fn reject(
    ctx: &Context,
    shutdown: &Shutdown,
    delivery: Delivery,
    reason: RejectReason,
) -> (Delivery, Option<Receipt>) {
    let receipt = Receipt::rejected(&reason);
    let why = receipt.error.clone().unwrap_or_default();
    tracing::warn!(reason = %why, message_id = ?delivery.properties.message_id(), "intent rejected");
    let copied = with_retries(shutdown, "dead-lettering a rejected intent", || {
        ctx.publish_dead_letter(INTENTS_QUEUE, &delivery, &why)
    })
    .await;
    match copied {
        Ok(()) => (delivery, Some(receipt)),
        Err(e) => {
            tracing::error!(error = %e, "rejected intent not dead-lettered; returning it to the queue");
            (delivery, None)
        }
    }
}

/// Admits the valid intents of a batch in one statement and publishes the new
/// jobs' first attempts; each delivery's receipt, or `None` when it goes back to
/// the queue (the database could not be reached).
async fn admit(
    ctx: &Context,
    shutdown: &Shutdown,
    valid: Vec<(Delivery, NewJob)>,
) -> Vec<(Delivery, Option<Receipt>)> {
    if valid.is_empty() {
        return Vec::new();
    }
    let (deliveries, batch): (Vec<Delivery>, Vec<NewJob>) = valid.into_iter().unzip();
    let rows =
        crate::edges::metrics::timed("intake_admit", admit_rows(ctx, shutdown, &batch)).await;
    // Intents Postgres refused to store are rejected, like any invalid intent.
    let mut answered = Vec::with_capacity(batch.len());
    let mut admissions = Vec::with_capacity(batch.len());
    let mut kept = Vec::with_capacity(batch.len());
    for ((delivery, new_job), row) in deliveries.into_iter().zip(batch).zip(rows) {
        match row {
            Some(Ok(Admission::Refused(reason))) => {
                crate::edges::metrics::owner_refused(&new_job.intent.owner_id, "budget_exceeded");
                answered.push(reject(ctx, shutdown, delivery, reason).await);
            }
            Some(Ok(admission)) => {
                admissions.push(admission);
                kept.push((delivery, new_job));
            }
            Some(Err(reason)) => answered.push(reject(ctx, shutdown, delivery, reason).await),
            None => answered.push((delivery, None)),
        }
    }
    let (deliveries, batch): (Vec<Delivery>, Vec<NewJob>) = kept.into_iter().unzip();
    let mut publish = Vec::new();
    let mut receipts = Vec::with_capacity(batch.len());
    for (new_job, admission) in batch.iter().zip(admissions) {
        receipts.push(Some(match admission {
            Admission::Created { job_id, publish: message } => {
                tracing::info!(%job_id, owner_id = %new_job.intent.owner_id, operation = %new_job.intent.operation, paced = message.is_none(), "job created");
                publish.extend(message);
                Receipt::for_job(Outcome::Created, job_id)
            }
            Admission::Duplicate { job_id } => {
                tracing::info!(%job_id, "duplicate intent: same identity, same fingerprint");
                Receipt::for_job(Outcome::Duplicate, job_id)
            }
            // Taken out above, with the intents Postgres refused.
            Admission::Refused(reason) => Receipt::rejected(&reason),
            Admission::Conflict => {
                tracing::warn!(
                    owner_id = %new_job.intent.owner_id,
                    idempotency_key = %new_job.intent.idempotency_key,
                    "conflicting intent: same identity, different fingerprint"
                );
                Receipt::conflict()
            }
        }));
    }
    // The first attempts this worker's own consumers have a free call slot
    // for are claimed and called at once (runtime::own_consumers); their
    // messages are published all the same.
    ctx.own_consumers.offer(&publish);
    // If this publish fails the outbox rows stay, and the relay publishes them
    // when their lease runs out: nothing is lost.
    if !publish.is_empty() {
        let published =
            crate::edges::metrics::timed("intake_publish", ctx.publish_outbox(&publish));
        if let Err(e) = published.await {
            tracing::warn!(error = %e, "first attempts not all published yet; the relay will");
        }
    }
    answered.extend(deliveries.into_iter().zip(receipts));
    answered
}

/// Admits a batch with one statement. If Postgres refuses its data, admits the
/// intents one by one, so that only the one it refuses fails. For each intent:
/// its admission, the reason it can never be stored, or `None` to requeue it.
pub async fn admit_rows(
    ctx: &Context,
    shutdown: &Shutdown,
    batch: &[NewJob],
) -> Vec<Option<Result<Admission, RejectReason>>> {
    let requeue = |e: &dyn std::fmt::Display, n: usize| {
        tracing::error!(error = %e, intents = n, "intents not admitted; returning them to the queue");
        (0..n).map(|_| None).collect()
    };
    match admit_now(ctx, shutdown, batch).await {
        Ok(admissions) if admissions.len() == batch.len() => {
            admissions.into_iter().map(|a| Some(Ok(a))).collect()
        }
        Ok(admissions) => requeue(
            &format!("{} answers for {} intents", admissions.len(), batch.len()),
            batch.len(),
        ),
        Err(WorkerError::Store(e)) if e.is_data_error() && batch.len() > 1 => {
            tracing::warn!(error = %e, "the database refused a batch; admitting its intents one by one");
            let mut rows = Vec::with_capacity(batch.len());
            for one in batch.chunks(1) {
                rows.push(match admit_now(ctx, shutdown, one).await {
                    Ok(mut a) if a.len() == 1 => Some(Ok(a.remove(0))),
                    Err(WorkerError::Store(e)) if e.is_data_error() => {
                        Some(Err(RejectReason::Unstorable(e.to_string())))
                    }
                    Ok(_) => None,
                    Err(e) => requeue(&e, 1).pop().flatten(),
                });
            }
            rows
        }
        Err(WorkerError::Store(e)) if e.is_data_error() => {
            vec![Some(Err(RejectReason::Unstorable(e.to_string())))]
        }
        Err(e) => requeue(&e, batch.len()),
    }
}

/// Publishes the receipt to the intent's `reply_to`, if it asked for one.
/// A `reply_to` that names a queue receipts may not go to: the receipt would
/// be published there with the worker's own broker permissions, so a publisher
/// could drop forged messages into another service's queue or into onejob's.
fn refused_reply_to(ctx: &Context, delivery: &Delivery) -> Option<RejectReason> {
    let reply_to = delivery.properties.reply_to().as_ref()?;
    (!ctx.config.worker.reply_allowed(reply_to.as_str()))
        .then(|| RejectReason::ReplyToRefused(reply_to.to_string()))
}

/// Publishes the receipt to the delivery's `reply_to`, if it asked for one
/// where receipts may go ([`refused_reply_to`]).
async fn send_receipt(
    ctx: &Context,
    shutdown: &Shutdown,
    delivery: &Delivery,
    receipt: &Receipt,
) -> Result<()> {
    let Some(reply_to) = delivery.properties.reply_to() else {
        return Ok(());
    };
    if refused_reply_to(ctx, delivery).is_some() {
        return Ok(());
    }
    let body = serde_json::to_vec(receipt).unwrap_or_default();
    let mut props = broker::json_properties();
    if let Some(id) = delivery.properties.correlation_id() {
        props = props.with_correlation_id(id.clone());
    }
    with_retries(shutdown, "sending a receipt", || async {
        Ok(ctx
            .publisher
            .publish("", reply_to.as_str(), &body, props.clone(), false)
            .await?)
    })
    .await
}

async fn admit_now(ctx: &Context, shutdown: &Shutdown, rows: &[NewJob]) -> Result<Vec<Admission>> {
    with_retries(shutdown, "admitting intents", || async {
        Ok(ctx.store.admission().admit(rows).await?)
    })
    .await
}
