//! Jobs: admission (identity through the UNIQUE constraint), the views operators
//! and owners read, and cancellation.

use super::*;

impl Store {
    /// Turns validated intents into jobs. Identity is decided by the UNIQUE
    /// constraint through `INSERT … ON CONFLICT DO NOTHING`, never by a check first;
    /// the job, its first attempt and the attempt's outbox row commit together.
    pub async fn admit(&self, batch: &[NewJob]) -> Result<Vec<Admission>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.retrying(|| self.admit_once(batch)).await
    }

    async fn admit_once(&self, batch: &[NewJob]) -> Result<Vec<Admission>> {
        // Rows are inserted in identity order, so that batches which overlap take
        // their locks in one order and do not deadlock; within a batch, the first
        // intent of an identity stays first (the sort is stable).
        let mut sorted: Vec<&NewJob> = batch.iter().collect();
        sorted.sort_by(|a, b| {
            (&a.intent.owner_id, &a.intent.idempotency_key)
                .cmp(&(&b.intent.owner_id, &b.intent.idempotency_key))
        });
        let mut tx = self.pool.begin().await?;
        let created = insert_new(&mut tx, &sorted).await?;
        let drafts: Vec<OutboxDraft> = created
            .iter()
            .map(|r| self.routes.attempt_draft(r.id, r.job_id, &r.provider, None))
            .collect();
        let mut publish_by_attempt: HashMap<String, OutboxMessage> = self
            .insert_outbox(&mut tx, &drafts)
            .await?
            .into_iter()
            .map(|m| (m.message_id.clone(), m))
            .collect();
        let mut publish_by_job: HashMap<Uuid, OutboxMessage> = HashMap::new();
        for r in &created {
            let message = publish_by_attempt
                .remove(&r.id.to_string())
                .ok_or_else(|| corrupt(format!("no outbox row for attempt {}", r.id)))?;
            publish_by_job.insert(r.job_id.0, message);
        }
        let existing = existing_identities(&mut tx, batch).await?;
        tx.commit().await?;
        self.recover_unseen(batch, &existing, &mut publish_by_job)
            .await?;
        receipts(batch, publish_by_job, &existing)
    }

    /// A job that bears this batch's own id was created by an earlier run of
    /// [`Store::admit_once`] whose commit went through unseen (the connection
    /// dropped at COMMIT, and `retrying` ran it again): it is still `created`,
    /// with the outbox row that run wrote.
    async fn recover_unseen(
        &self,
        batch: &[NewJob],
        existing: &HashMap<(String, String), (Uuid, String)>,
        publish_by_job: &mut HashMap<Uuid, OutboxMessage>,
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
            let by_attempt: HashMap<String, OutboxMessage> = sqlx::query_as!(
                OutboxMessage,
                "SELECT id, exchange, routing_key, message_id, body, traceparent, tracestate
                 FROM outbox WHERE message_id = ANY($1)",
                &unseen,
            )
            .fetch_all(&self.pool)
            .await?
            .into_iter()
            .map(|m| (m.message_id.clone(), m))
            .collect();
            for n in batch {
                if let Some(m) = by_attempt.get(&n.attempt_id.to_string()) {
                    publish_by_job.insert(n.job_id.0, m.clone());
                }
            }
        }
        Ok(())
    }

    /// Where an attempt stands: its job, its status, and its job's status.
    pub async fn attempt_state(
        &self,
        attempt: AttemptId,
    ) -> Result<Option<(JobId, AttemptStatus, JobStatus)>> {
        let row = sqlx::query!(
            r#"SELECT a.job_id AS "job_id: JobId", a.status AS "attempt: AttemptStatus",
                      j.status AS "job: JobStatus"
               FROM attempts a JOIN jobs j ON j.id = a.job_id
               WHERE a.id = $1"#,
            attempt.0,
        )
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| (r.job_id, r.attempt, r.job)))
    }

    /// The job an attempt belongs to.
    pub async fn attempt_job(&self, attempt: AttemptId) -> Result<Option<JobId>> {
        Ok(sqlx::query_scalar!(
            r#"SELECT job_id AS "job_id: JobId" FROM attempts WHERE id = $1"#,
            attempt.0
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// A job with its attempts.
    pub async fn job(&self, id: JobId) -> Result<Option<JobView>> {
        let row = sqlx::query_as!(
            JobRow,
            r#"SELECT id AS "id: JobId", owner_id, idempotency_key, request_fingerprint, operation,
                      input, provider, status AS "status: JobStatus", version,
                      completed_by AS "completed_by: AttemptId", result, error, created_at,
                      updated_at
               FROM jobs WHERE id = $1"#,
            id.0
        )
        .fetch_optional(&self.pool)
        .await?;
        self.view(row).await
    }

    /// A job with its attempts, only if it belongs to `owner_id`: the owner check
    /// is part of the query, so another owner's job is never even read.
    pub async fn owned_job(&self, id: JobId, owner_id: &str) -> Result<Option<JobView>> {
        let row = sqlx::query_as!(
            JobRow,
            r#"SELECT id AS "id: JobId", owner_id, idempotency_key, request_fingerprint, operation,
                      input, provider, status AS "status: JobStatus", version,
                      completed_by AS "completed_by: AttemptId", result, error, created_at,
                      updated_at
               FROM jobs WHERE id = $1 AND owner_id = $2"#,
            id.0,
            owner_id
        )
        .fetch_optional(&self.pool)
        .await?;
        self.view(row).await
    }

    /// The job with this identity, if any.
    pub async fn find_job(&self, owner_id: &str, idempotency_key: &str) -> Result<Option<JobView>> {
        let row = sqlx::query_as!(
            JobRow,
            r#"SELECT id AS "id: JobId", owner_id, idempotency_key, request_fingerprint, operation,
                      input, provider, status AS "status: JobStatus", version,
                      completed_by AS "completed_by: AttemptId", result, error, created_at,
                      updated_at
               FROM jobs WHERE owner_id = $1 AND idempotency_key = $2"#,
            owner_id,
            idempotency_key
        )
        .fetch_optional(&self.pool)
        .await?;
        self.view(row).await
    }

    async fn view(&self, row: Option<JobRow>) -> Result<Option<JobView>> {
        let Some(job) = row else {
            return Ok(None);
        };
        let attempts = sqlx::query_as!(
            AttemptView,
            r#"SELECT id AS "id: AttemptId", job_id AS "job_id: JobId", number, provider,
                      status AS "status: AttemptStatus", error, created_at, not_before,
                      started_at, finished_at, provider_request_id, usage,
                      evidence_looks, evidence_last_at, evidence_note, evidence_next_at
               FROM attempts WHERE job_id = $1 ORDER BY number"#,
            job.id.0
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(Some(job.with(attempts)))
    }

    /// Cancels a job: the version is bumped, queued and unknown attempts are
    /// cancelled, and an attempt still in flight is left to finish, so that its late
    /// result is `discarded` by the compare-and-swap. Refused on a terminal job.
    /// The cancellation is recorded in the audit table, in its transaction.
    pub async fn cancel_job(
        &self,
        job: JobId,
        actor: &Actor,
    ) -> Result<Result<Vec<OutboxMessage>, Refusal>> {
        let Some(status) = sqlx::query_scalar!(
            r#"SELECT status AS "status: JobStatus" FROM jobs WHERE id = $1"#,
            job.0
        )
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(Err(Refusal::NotFound(format!("job {job}"))));
        };
        if status.is_terminal() {
            return Ok(Err(Refusal::terminal_job(job, status)));
        }
        let reason = "cancelled: by an operator";
        let action = Action {
            id: Some(Uuid::now_v7()),
            action: "job.cancel",
            job: Some(job),
            ..Action::default()
        };
        match self
            .retrying(|| self.cancel_once(job, None, reason, (actor, &action)))
            .await?
        {
            Some(publish) => Ok(Ok(publish)),
            // A try whose commit reply was lost, run again, finds the job
            // ended: by this very cancellation when its audit row is there.
            // Its event is the relay's to publish.
            None if self
                .recorded(action.id.unwrap_or_default())
                .await?
                .is_some() =>
            {
                Ok(Ok(Vec::new()))
            }
            None => Ok(Err(Refusal::Terminal(format!(
                "job {job} ended while it was being cancelled; look again"
            )))),
        }
    }

    /// One cancellation transaction, recorded as `audit` says; `None` if the
    /// job had already ended.
    pub(super) async fn cancel_once(
        &self,
        job: JobId,
        target: Option<AttemptId>,
        reason: &str,
        audit: (&Actor, &Action<'_>),
    ) -> Result<Option<Vec<OutboxMessage>>> {
        let mut tx = self.pool.begin().await?;
        // The job first: once it is locked and cancelled, no retry or hedge can add
        // an attempt to it (they lock the job before they insert one), and the
        // statement below, with its fresh snapshot, sees every attempt it has.
        let Some(ended) = sqlx::query_as!(
            Ended,
            r#"UPDATE jobs j
               SET status = 'cancelled', version = j.version + 1, updated_at = now(), error = $2
               WHERE j.id = $1 AND j.status IN ('queued', 'running', 'unknown')
               RETURNING j.id AS "job_id: JobId", j.version, j.owner_id, j.idempotency_key,
                         j.operation, j.status AS "status: JobStatus",
                         j.completed_by AS "completed_by: AttemptId", j.result, j.error"#,
            job.0,
            reason
        )
        .fetch_optional(&mut *tx)
        .await?
        else {
            return Ok(None);
        };
        sqlx::query!(
            "UPDATE attempts SET status = 'cancelled', finished_at = now(),
                    error = CASE WHEN id = $2 THEN 'cancelled: resolved as cancelled by an operator'
                                 ELSE 'cancelled: its job was cancelled' END
             WHERE job_id = $1
               AND (status IN ('queued', 'unknown') OR (id = $2 AND status = 'started'))",
            job.0,
            target.map(|a| a.0) as Option<Uuid>
        )
        .execute(&mut *tx)
        .await?;
        audit::record(&mut tx, audit.0, audit.1).await?;
        let draft = ended.draft(&self.routes);
        let publish = self.insert_outbox(&mut tx, &[draft]).await?;
        tx.commit().await?;
        Ok(Some(publish))
    }
}

/// Inserts the jobs that are new, each with its first attempt, in one
/// statement; returns the attempts created.
async fn insert_new(tx: &mut PgConnection, sorted: &[&NewJob]) -> Result<Vec<CreatedAttempt>> {
    let job_ids: Vec<Uuid> = sorted.iter().map(|n| n.job_id.0).collect();
    let owners: Vec<String> = sorted.iter().map(|n| n.intent.owner_id.clone()).collect();
    let keys: Vec<String> = sorted
        .iter()
        .map(|n| n.intent.idempotency_key.clone())
        .collect();
    let fingerprints: Vec<String> = sorted.iter().map(|n| n.fingerprint.0.clone()).collect();
    let operations: Vec<String> = sorted.iter().map(|n| n.intent.operation.clone()).collect();
    let inputs: Vec<Value> = sorted
        .iter()
        .map(|n| Value::Object(n.intent.input.clone()))
        .collect();
    let pinned: Vec<Option<String>> = sorted.iter().map(|n| n.intent.provider.clone()).collect();
    let attempt_ids: Vec<Uuid> = sorted.iter().map(|n| n.attempt_id.0).collect();
    let providers: Vec<String> = sorted.iter().map(|n| n.provider.clone()).collect();
    let traces: Vec<Option<&crate::trace::TraceContext>> =
        sorted.iter().map(|n| n.trace.as_ref()).collect();
    let traceparents: Vec<Option<String>> = traces
        .iter()
        .map(|t| t.map(crate::trace::TraceContext::traceparent))
        .collect();
    let tracestates: Vec<Option<String>> = traces
        .iter()
        .map(|t| t.and_then(|t| t.state.clone()))
        .collect();
    Ok(sqlx::query_as!(
        CreatedAttempt,
        r#"WITH input AS (
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                                  $6::jsonb[], $7::text[], $8::uuid[], $9::text[],
                                  $10::text[], $11::text[])
                 WITH ORDINALITY
                 AS t(job_id, owner_id, idempotency_key, fingerprint, operation, input, pinned,
                      attempt_id, provider, traceparent, tracestate, position)
         ), new_jobs AS (
             INSERT INTO jobs (id, owner_id, idempotency_key, request_fingerprint, operation, input,
                               provider, traceparent, tracestate)
             SELECT job_id, owner_id, idempotency_key, fingerprint, operation, input, pinned,
                    traceparent, tracestate
             FROM input ORDER BY position
             ON CONFLICT (owner_id, idempotency_key) DO NOTHING
             RETURNING id
         )
         INSERT INTO attempts (id, job_id, number, provider)
         SELECT i.attempt_id, i.job_id, 1, i.provider FROM input i JOIN new_jobs n ON n.id = i.job_id
         RETURNING job_id AS "job_id: JobId", id AS "id: AttemptId", provider"#,
        &job_ids,
        &owners,
        &keys,
        &fingerprints,
        &operations,
        &inputs,
        &pinned as &[Option<String>],
        &attempt_ids,
        &providers,
        &traceparents as &[Option<String>],
        &tracestates as &[Option<String>],
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// The created attempt of a new job.
struct CreatedAttempt {
    job_id: JobId,
    id: AttemptId,
    provider: String,
}

/// The jobs that hold the batch's identities now: `(owner, key) → (job,
/// fingerprint)`. A separate statement takes a fresh snapshot, so it sees rows
/// that a concurrent transaction committed while the insert waited on the
/// conflict.
async fn existing_identities(
    tx: &mut PgConnection,
    batch: &[NewJob],
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
    .fetch_all(&mut *tx)
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
    mut publish_by_job: HashMap<Uuid, OutboxMessage>,
    existing: &HashMap<(String, String), (Uuid, String)>,
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
                None => Err(corrupt(format!(
                    "job for owner {:?} key {:?} neither inserted nor found",
                    n.intent.owner_id, n.intent.idempotency_key
                ))),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let published = HashMap::from([(created.job_id.0, message(1))]);
        let batch = [changed, created.clone(), same];
        let out = receipts(&batch, published, &existing).unwrap();
        assert_eq!(out[0], Admission::Conflict);
        assert_eq!(
            out[1],
            Admission::Created {
                job_id: created.job_id,
                publish: message(1)
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
            receipts(&[lost], HashMap::new(), &HashMap::new()),
            Err(StoreError::Corrupt(_))
        ));
    }
}
