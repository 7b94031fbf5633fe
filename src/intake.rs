//! The intake role: intents in, jobs out.
//!
//! Each intent is validated strictly, fingerprinted, and admitted through the
//! store's `INSERT … ON CONFLICT DO NOTHING`. Then, in this order: the first
//! attempt is published (confirmed), the receipt is sent, and the delivery is
//! acked. A bad intent is copied to `onejob.intents.dlq` with its reason and gets
//! a `rejected` receipt. A crash anywhere means a redelivery, which comes out as a
//! `duplicate` naming the same job.

use lapin::message::Delivery;

use crate::broker::{self, INTENTS_QUEUE};
use crate::domain::{AttemptId, JobId};
use crate::intent::{Intent, Outcome, Receipt, RejectReason};
use crate::shutdown::Shutdown;
use crate::store::{Admission, NewJob};
use crate::worker::{self, Context, Result, with_retries};

/// Runs intake until shutdown.
pub async fn run(ctx: Context, shutdown: Shutdown) -> Result<()> {
    let prefetch = ctx.config.worker.intake_prefetch;
    worker::consume(&ctx, INTENTS_QUEUE, prefetch, &shutdown, |delivery| {
        let ctx = ctx.clone();
        async move { handle(&ctx, delivery).await }
    })
    .await
}

/// Validates an intent body against the contract and the configuration.
pub fn validate(ctx: &Context, body: &[u8]) -> Result<NewJob, RejectReason> {
    let intent = Intent::parse(body, ctx.config.worker.max_message_bytes)?;
    let (_, provider) = ctx.config.admit(&intent)?;
    Ok(NewJob {
        job_id: JobId::new(),
        attempt_id: AttemptId::new(),
        fingerprint: intent.fingerprint(),
        intent,
        provider,
    })
}

async fn handle(ctx: &Context, delivery: Delivery) {
    if let Err(e) = process(ctx, &delivery).await {
        tracing::error!(error = %e, "intent not settled; returning it to the queue");
        worker::requeue(&delivery).await;
    }
}

async fn process(ctx: &Context, delivery: &Delivery) -> Result<()> {
    let receipt = match validate(ctx, &delivery.data) {
        Err(reason) => {
            let receipt = Receipt::rejected(&reason);
            let why = receipt.error.clone().unwrap_or_default();
            tracing::warn!(reason = %why, message_id = ?delivery.properties.message_id(), "intent rejected");
            with_retries("dead-lettering a rejected intent", || {
                ctx.publish_dead_letter(INTENTS_QUEUE, delivery, &why)
            })
            .await?;
            receipt
        }
        Ok(new_job) => {
            let batch = [new_job];
            let admission = with_retries("admitting an intent", || async {
                let mut admitted = ctx.store.admit(&batch).await?;
                Ok(admitted.pop())
            })
            .await?;
            let [new_job] = batch;
            match admission {
                Some(Admission::Created { job_id, publish }) => {
                    tracing::info!(%job_id, owner_id = %new_job.intent.owner_id, operation = %new_job.intent.operation, "job created");
                    // If this publish fails the outbox row stays, and the relay
                    // publishes it when the lease runs out: nothing is lost.
                    if let Err(e) = ctx.publish_outbox(std::slice::from_ref(&publish)).await {
                        tracing::warn!(%job_id, error = %e, "first attempt not published yet; the relay will");
                    }
                    Receipt::for_job(Outcome::Created, job_id)
                }
                Some(Admission::Duplicate { job_id }) => {
                    tracing::info!(%job_id, "duplicate intent: same identity, same fingerprint");
                    Receipt::for_job(Outcome::Duplicate, job_id)
                }
                Some(Admission::Conflict) => {
                    tracing::warn!(
                        owner_id = %new_job.intent.owner_id,
                        idempotency_key = %new_job.intent.idempotency_key,
                        "conflicting intent: same identity, different fingerprint"
                    );
                    Receipt::conflict()
                }
                None => {
                    return Err(
                        crate::store::StoreError::Corrupt("admit returned nothing".into()).into(),
                    );
                }
            }
        }
    };
    send_receipt(ctx, delivery, &receipt).await?;
    worker::ack(delivery).await?;
    crate::metrics::intent(receipt.outcome);
    Ok(())
}

/// Publishes the receipt to the intent's `reply_to`, if it asked for one.
async fn send_receipt(ctx: &Context, delivery: &Delivery, receipt: &Receipt) -> Result<()> {
    let Some(reply_to) = delivery.properties.reply_to() else {
        return Ok(());
    };
    let body = serde_json::to_vec(receipt).unwrap_or_default();
    let mut props = broker::json_properties();
    if let Some(id) = delivery.properties.correlation_id() {
        props = props.with_correlation_id(id.clone());
    }
    with_retries("sending a receipt", || async {
        Ok(ctx
            .publisher
            .publish("", reply_to.as_str(), &body, props.clone(), false)
            .await?)
    })
    .await
}
