//! Dead letters read back: a valid intent the broker dead-lettered for its
//! delivery limit becomes a job all the same, and an attempt whose message
//! died while it was still `queued` is failed with the dead letter's reason.
//! Each letter stays for an operator.

use crate::policy::next::FailedJob;
use crate::shared::planner;
use crate::shared::runtime::{Context, Result};
use crate::trace::TraceContext;

/// Marks attempts whose messages died in their dead-letter queue while they were
/// still `queued`: `failed`, with the dead letter's reason, and plans the next
/// attempt. Browsing returns every dead letter to its queue.
pub(super) async fn reflect_dead_letters(ctx: &Context) -> Result<()> {
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
    let planner = planner::load_all(&ctx.config, &ctx.store).await?;
    let plan = |f: &FailedJob| planner.plan(f);
    let (settled, publish) = ctx.store.settle().fail_queued(&dead, true, &plan).await?;
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
pub(super) async fn reflect_dead_intents(ctx: &Context) -> Result<()> {
    let queue = crate::broker::dead_letter_queue(crate::broker::INTENTS_QUEUE);
    let mut valid: Vec<crate::edges::store::NewJob> = Vec::new();
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
    let admitted = ctx.store.admission().admit(&valid).await?;
    let mut publish = Vec::new();
    for (new, admission) in valid.iter().zip(admitted) {
        if let crate::edges::store::Admission::Created {
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
