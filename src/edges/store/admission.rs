//! Admission: validated intents become jobs, each with its first attempt and
//! that attempt's outbox row; identity is decided by the UNIQUE constraint.

use crate::edges::store::handles::Admissions;
use std::collections::{BTreeSet, HashMap};

use serde_json::Value;
use uuid::Uuid;

use super::outbox::{InsertedRow, OutboxColumns};
use crate::domain::JobId;
use crate::edges::store::drafts::{OutboxDraft, OutboxMessage};
use crate::edges::store::error::{Result, corrupt};
use crate::edges::store::{Admission, NewJob};
use crate::intent::RejectReason;

impl Admissions<'_> {
    /// Turns validated intents into jobs. Identity is decided by the UNIQUE
    /// constraint through `INSERT … ON CONFLICT DO NOTHING`, never by a check first;
    /// the job, its first attempt and the attempt's outbox row commit together.
    pub async fn admit(self, batch: &[NewJob]) -> Result<Vec<Admission>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.0.retrying(|| self.admit_once(batch)).await
    }

    async fn admit_once(self, batch: &[NewJob]) -> Result<Vec<Admission>> {
        // Rows are inserted in identity order, so that batches which overlap take
        // their locks in one order and do not deadlock; within a batch, the first
        // intent of an identity stays first (the sort is stable).
        let mut sorted: Vec<&NewJob> = batch.iter().collect();
        sorted.sort_by(|a, b| {
            (&a.intent.owner_id, &a.intent.idempotency_key)
                .cmp(&(&b.intent.owner_id, &b.intent.idempotency_key))
        });
        // One statement, so one round trip and its own transaction: a lone
        // intent pays one commit, with no BEGIN and COMMIT of their own.
        let drafts: Vec<OutboxDraft> = sorted
            .iter()
            .map(|n| {
                self.0
                    .routes
                    .attempt_draft(n.attempt_id, n.job_id, &n.provider, None)
            })
            .collect();
        let job_by_message: HashMap<&str, Uuid> = drafts
            .iter()
            .map(|d| (d.message_id.as_str(), d.job_id.0))
            .collect();
        let limits = self.admission_limits(batch).await?;
        let (rows, refused) = self
            .insert_within_budgets(&sorted, &drafts, &limits)
            .await?;
        let mut publish_by_job: HashMap<Uuid, Option<OutboxMessage>> = HashMap::new();
        for row in rows {
            let leased = row.leased;
            let message = row.message();
            let job = *job_by_message
                .get(message.message_id.as_str())
                .ok_or_else(|| {
                    corrupt(format!(
                        "an outbox row for no new job: {}",
                        message.message_id
                    ))
                })?;
            publish_by_job.insert(job, leased.then_some(message));
        }
        // After the insert has committed: its snapshot sees every identity,
        // those a concurrent admission committed while the insert waited on
        // the conflict included.
        let batch_refs: Vec<&NewJob> = batch.iter().collect();
        let existing = existing_identities(&self.0.per_job, &batch_refs).await?;
        self.recover_unseen(batch, &existing, &mut publish_by_job)
            .await?;
        receipts(batch, publish_by_job, &existing, refused)
    }

    /// Inserts the new jobs ([`Admissions::insert_new`](crate::edges::store::Admissions::insert_new)). With no owner of the
    /// batch under a budget, that is one statement, its own transaction.
    /// Otherwise the owners' budget locks come first, then what their budgets
    /// leave is read, and the jobs that fit are inserted with their
    /// reservations, in one transaction that holds the locks until then; the
    /// jobs that do not fit are left out, and returned with their refusals.
    async fn insert_within_budgets(
        self,
        sorted: &[&NewJob],
        drafts: &[OutboxDraft],
        limits: &AdmissionLimits,
    ) -> Result<(Vec<InsertedRow>, HashMap<Uuid, RejectReason>)> {
        if limits.budgeted.is_empty() {
            let reserves = vec![0; sorted.len()];
            let rows = self
                .insert_new(&self.0.per_job, sorted, drafts, limits, (&reserves, &[]))
                .await?;
            return Ok((rows, HashMap::new()));
        }
        let mut tx = self.0.per_job.begin().await?;
        let rooms = super::budget::rooms(&mut tx, &limits.budgeted).await?;
        // Identities that have a job already make none, and reserve nothing.
        let existing = existing_identities(&mut *tx, sorted).await?;
        let (reserves, refused) = super::budget::fit(sorted, &rooms, &existing);
        let left_out: Vec<Uuid> = refused.keys().copied().collect();
        let rows = self
            .insert_new(&mut *tx, sorted, drafts, limits, (&reserves, &left_out))
            .await?;
        tx.commit().await?;
        Ok((rows, refused))
    }

    /// What admission must know of the batch's owners: who has a budget (its
    /// new jobs reserve), who has a rate (its new jobs' first attempts are
    /// paced), and who has `max_in_flight`.
    async fn admission_limits(self, batch: &[NewJob]) -> Result<AdmissionLimits> {
        let owners: Vec<String> = batch
            .iter()
            .map(|n| n.intent.owner_id.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let mut out = AdmissionLimits::default();
        for (owner, limits) in self.0.owners().admission_owners(&owners).await? {
            if limits.daily_tokens > 0 {
                out.budgeted.push((owner.clone(), limits.daily_tokens));
            }
            if limits.max_in_flight > 0 {
                out.counted.push(owner.clone());
            }
            if let Some((rate, burst)) = limits.bucket() {
                out.paced.push(owner);
                out.rates.push(rate);
                out.bursts.push(burst);
            }
        }
        Ok(out)
    }

    /// A job that bears this batch's own id was created by an earlier run of
    /// [`Admissions::admit_once`](crate::edges::store::Admissions::admit_once) whose commit went through unseen (the connection
    /// dropped before the insert's reply, and `retrying` ran it again): it is
    /// still `created`, with the outbox row that run wrote.
    async fn recover_unseen(
        self,
        batch: &[NewJob],
        existing: &HashMap<(String, String), (Uuid, String)>,
        publish_by_job: &mut HashMap<Uuid, Option<OutboxMessage>>,
    ) -> Result<()> {
        let unseen: Vec<String> = batch
            .iter()
            .filter(|n| {
                !publish_by_job.contains_key(&n.job_id.0)
                    && existing
                        .get(&(n.intent.owner_id.clone(), n.intent.idempotency_key.clone()))
                        .is_some_and(|(id, _)| *id == n.job_id.0)
            })
            .map(|n| n.attempt_id.to_string())
            .collect();
        if !unseen.is_empty() {
            let by_attempt: HashMap<String, InsertedRow> = sqlx::query_as!(
                InsertedRow,
                r#"SELECT id AS "id!", exchange AS "exchange!", routing_key AS "routing_key!",
                          message_id AS "message_id!", body AS "body!", traceparent, tracestate,
                          not_before <= now() AS "leased!"
                   FROM outbox WHERE message_id = ANY($1)
                   UNION ALL
                   -- Held with its message (no outbox row yet): the relay's
                   -- once it is handed out.
                   SELECT 0, exchange, routing_key, attempt_id::text, body, NULL, NULL, false
                   FROM turns
                   WHERE attempt_id::text = ANY($1) AND body IS NOT NULL
                     AND handed_out_at IS NULL"#,
                &unseen,
            )
            .fetch_all(&self.0.pool)
            .await?
            .into_iter()
            .map(|m| (m.message_id.clone(), m))
            .collect();
            for n in batch {
                if let Some(m) = by_attempt.get(&n.attempt_id.to_string()) {
                    // A row its rate holds back is the relay's to publish.
                    let m = m.clone();
                    publish_by_job.insert(n.job_id.0, m.leased.then(|| m.message()));
                }
            }
        }
        Ok(())
    }

    /// Inserts the jobs that are new, each with its first attempt and that
    /// attempt's outbox row (`drafts`, one per intent, in `sorted`'s order), in
    /// one statement; returns the outbox rows written: those due now are
    /// leased for publishing, and those the owner's rate holds back are the
    /// relay's to publish when due.
    /// The trace context comes from the input, not from `jobs`: a statement does
    /// not see the rows its own parts insert.
    ///
    /// Each job reserves `reserves`' tokens (by position, 0 for none), and
    /// the jobs `left_out` (refused for their budgets) are not inserted. The
    /// new jobs of owners with a rate take their places in the owner's bucket
    /// (`owner_pace_take`, in the migration), and each first attempt gets its
    /// due time: those due now are leased to this worker, the rest are left
    /// to the relay.
    async fn insert_new(
        self,
        executor: impl sqlx::PgExecutor<'_>,
        sorted: &[&NewJob],
        drafts: &[OutboxDraft],
        limits: &AdmissionLimits,
        (reserves, left_out): (&[i64], &[Uuid]),
    ) -> Result<Vec<InsertedRow>> {
        let c = JobColumns::of(sorted);
        let outbox = OutboxColumns::of(drafts);
        let (share_providers, share_sizes): (Vec<String>, Vec<i64>) =
            self.0.routes.shares.iter().cloned().unzip();
        let rows = sqlx::query_file_as!(
            InsertedRow,
            "src/edges/store/admission.sql",
            &c.job_ids,
            &c.owners,
            &c.keys,
            &c.fingerprints,
            &c.operations,
            &c.inputs,
            &c.pinned as &[Option<String>],
            &c.attempt_ids,
            &c.providers,
            &c.traceparents as &[Option<String>],
            &c.tracestates as &[Option<String>],
            &outbox.exchanges,
            &outbox.routing_keys,
            &outbox.message_ids,
            &outbox.bodies,
            self.0.routes.lease.as_secs_f64(),
            left_out,
            &limits.paced,
            &limits.rates,
            &limits.bursts,
            &share_providers,
            &share_sizes,
            &limits.counted,
            reserves,
        )
        .fetch_all(executor)
        .await?;
        Ok(rows)
    }
}

/// What admission applies of the batch's owners' limits.
#[derive(Default)]
struct AdmissionLimits {
    /// The owners with a daily budget, each with its `daily_tokens`.
    budgeted: Vec<(String, i64)>,
    /// The owners with a rate, each with its rate and its burst.
    paced: Vec<String>,
    rates: Vec<f64>,
    bursts: Vec<i64>,
    /// The owners with `max_in_flight`: all their turns are held, for the
    /// dispatcher to hand out as their flight allows.
    counted: Vec<String>,
}

/// The new jobs, as the columns the admission statement unnests.
#[derive(Default)]
struct JobColumns {
    job_ids: Vec<Uuid>,
    owners: Vec<String>,
    keys: Vec<String>,
    fingerprints: Vec<String>,
    operations: Vec<String>,
    inputs: Vec<Value>,
    pinned: Vec<Option<String>>,
    attempt_ids: Vec<Uuid>,
    providers: Vec<String>,
    traceparents: Vec<Option<String>>,
    tracestates: Vec<Option<String>>,
}

impl JobColumns {
    fn of(sorted: &[&NewJob]) -> Self {
        let mut c = JobColumns::default();
        for n in sorted {
            c.job_ids.push(n.job_id.0);
            c.owners.push(n.intent.owner_id.clone());
            c.keys.push(n.intent.idempotency_key.clone());
            c.fingerprints.push(n.fingerprint.0.clone());
            c.operations.push(n.intent.operation.clone());
            c.inputs.push(Value::Object(n.intent.input.clone()));
            c.pinned.push(n.intent.provider.clone());
            c.attempt_ids.push(n.attempt_id.0);
            c.providers.push(n.provider.clone());
            c.traceparents.push(
                n.trace
                    .as_ref()
                    .map(crate::trace::TraceContext::traceparent),
            );
            c.tracestates
                .push(n.trace.as_ref().and_then(|t| t.state.clone()));
        }
        c
    }
}

/// The jobs that hold the batch's identities now: `(owner, key) → (job,
/// fingerprint)`, read after the insert: a fresh snapshot, so it sees rows
/// that a concurrent admission committed while the insert waited on the
/// conflict.
pub(super) async fn existing_identities(
    executor: impl sqlx::PgExecutor<'_>,
    batch: &[&NewJob],
) -> Result<HashMap<(String, String), (Uuid, String)>> {
    let owners: Vec<String> = batch.iter().map(|n| n.intent.owner_id.clone()).collect();
    let keys: Vec<String> = batch
        .iter()
        .map(|n| n.intent.idempotency_key.clone())
        .collect();
    Ok(sqlx::query!(
        "SELECT j.owner_id, j.idempotency_key, j.id, j.request_fingerprint
         FROM jobs j
         JOIN unnest($1::text[], $2::text[]) AS i(owner_id, idempotency_key)
           ON j.owner_id = i.owner_id AND j.idempotency_key = i.idempotency_key",
        &owners,
        &keys,
    )
    .fetch_all(executor)
    .await?
    .into_iter()
    .map(|r| {
        (
            (r.owner_id, r.idempotency_key),
            (r.id, r.request_fingerprint),
        )
    })
    .collect())
}

/// Each intent's admission, in batch order: created (with its outbox row),
/// a duplicate of the job that holds its identity with the same fingerprint,
/// or a conflict with one that holds it with another.
fn receipts(
    batch: &[NewJob],
    mut publish_by_job: HashMap<Uuid, Option<OutboxMessage>>,
    existing: &HashMap<(String, String), (Uuid, String)>,
    mut refused: HashMap<Uuid, RejectReason>,
) -> Result<Vec<Admission>> {
    batch
        .iter()
        .map(|n| {
            if let Some(publish) = publish_by_job.remove(&n.job_id.0) {
                return Ok(Admission::Created {
                    job_id: n.job_id,
                    publish,
                });
            }
            let key = (n.intent.owner_id.clone(), n.intent.idempotency_key.clone());
            match existing.get(&key) {
                Some((id, fp)) if *fp == n.fingerprint.0 => {
                    Ok(Admission::Duplicate { job_id: JobId(*id) })
                }
                Some(_) => Ok(Admission::Conflict),
                None => match refused.remove(&n.job_id.0) {
                    Some(reason) => Ok(Admission::Refused(reason)),
                    None => Err(corrupt(format!(
                        "job for owner {:?} key {:?} neither inserted nor found",
                        n.intent.owner_id, n.intent.idempotency_key
                    ))),
                },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::receipts;
    use crate::domain::{AttemptId, JobId};
    use crate::edges::store::drafts::OutboxMessage;
    use crate::edges::store::error::StoreError;
    use crate::edges::store::{Admission, NewJob};
    use crate::intent::Intent;
    use serde_json::Value;
    use std::collections::HashMap;

    fn new_job(owner: &str, key: &str, text: &str) -> NewJob {
        let intent = Intent {
            owner_id: owner.into(),
            idempotency_key: key.into(),
            operation: "summarize".into(),
            input: serde_json::json!({ "text": text })
                .as_object()
                .cloned()
                .unwrap(),
            provider: None,
        };
        NewJob {
            job_id: JobId::new(),
            attempt_id: AttemptId::new(),
            fingerprint: intent.fingerprint(),
            intent,
            provider: "primary".into(),
            trace: None,
            reserve: 0,
        }
    }

    fn message(id: i64) -> OutboxMessage {
        OutboxMessage {
            id,
            traceparent: None,
            tracestate: None,
            exchange: "onejob".into(),
            routing_key: "attempts.primary".into(),
            message_id: id.to_string(),
            body: Value::Null,
        }
    }

    #[test]
    fn receipts_follow_the_batch_order_and_the_identity_holder() {
        let created = new_job("a", "k1", "x");
        let same = new_job("a", "k2", "x");
        let changed = new_job("a", "k3", "y");
        let holder = (JobId::new().0, same.fingerprint.0.clone());
        let other = (JobId::new().0, "another fingerprint".to_owned());
        let existing = HashMap::from([
            (
                ("a".to_owned(), "k1".to_owned()),
                (created.job_id.0, created.fingerprint.0.clone()),
            ),
            (("a".to_owned(), "k2".to_owned()), holder.clone()),
            (("a".to_owned(), "k3".to_owned()), other),
        ]);
        let published = HashMap::from([(created.job_id.0, Some(message(1)))]);
        let batch = [changed, created.clone(), same];
        let out = receipts(&batch, published, &existing, HashMap::new()).unwrap();
        assert_eq!(out[0], Admission::Conflict);
        assert_eq!(
            out[1],
            Admission::Created {
                job_id: created.job_id,
                publish: Some(message(1))
            }
        );
        assert_eq!(
            out[2],
            Admission::Duplicate {
                job_id: JobId(holder.0)
            }
        );
    }

    #[test]
    fn an_identity_neither_inserted_nor_found_is_an_error_not_a_receipt() {
        let lost = new_job("a", "k", "x");
        assert!(matches!(
            receipts(&[lost], HashMap::new(), &HashMap::new(), HashMap::new()),
            Err(StoreError::Corrupt(_))
        ));
    }
}
