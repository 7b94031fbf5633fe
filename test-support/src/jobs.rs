//! Intents and jobs made for a test: submitted, admitted past intake, settled
//! as the attempt path does, or filled in bulk straight into the tables.

use std::time::Duration;

use onejob::edges::store::Store;
use sqlx::PgConnection;

/// Submits a `summarize` intent and returns the job its receipt names.
pub async fn submit(
    producer: &onejob_producer::Producer,
    owner: &str,
    key: &str,
    text: &str,
) -> onejob::domain::JobId {
    let receipt = producer
        .submit(&intent(owner, key, text))
        .await
        .expect("submit");
    receipt
        .job_id
        .unwrap_or_else(|| panic!("no job in receipt {receipt:?}"))
}

/// A validated `summarize` intent for the primary provider, ready to admit.
pub fn new_job(owner: &str, key: &str, text: &str) -> onejob::edges::store::NewJob {
    let intent = intent(owner, key, text);
    onejob::edges::store::NewJob {
        job_id: onejob::domain::JobId::new(),
        attempt_id: onejob::domain::AttemptId::new(),
        fingerprint: intent.fingerprint(),
        intent,
        provider: "primary".into(),
        trace: None,
        reserve: RESERVE,
    }
}

/// What a test intent made by [`new_job`] reserves of a budget: tests that
/// admit through the store directly fix it (a worker counts the prompt's
/// tokens, [`onejob::shared::runtime::reservation`]).
pub const RESERVE: i64 = 20;

/// An intent for the `summarize` operation.
pub fn intent(owner: &str, key: &str, text: &str) -> onejob::intent::Intent {
    onejob::intent::Intent {
        owner_id: owner.into(),
        idempotency_key: key.into(),
        operation: "summarize".into(),
        input: serde_json::json!({ "text": text })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        provider: None,
    }
}

/// Settles `batch` as the attempt path does: a settlement that comes back
/// `Busy` (its rows were held by another transaction, and nothing of it was
/// written) is settled again, alone, until it is not. What each came to, in
/// input order.
pub async fn settle_with(
    store: &Store,
    batch: &[onejob::edges::store::Finished],
    plan: &(dyn Fn(&onejob::policy::next::FailedJob) -> onejob::policy::next::NextStep + Sync),
) -> Vec<onejob::edges::store::Settled> {
    use onejob::edges::store::Settled;
    let mut settled = store.settle().finalize(batch, plan).await.unwrap().0;
    loop {
        let busy: Vec<usize> = (0..settled.len())
            .filter(|&i| settled[i] == Settled::Busy)
            .collect();
        if busy.is_empty() {
            return settled;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        let again: Vec<_> = busy.iter().map(|&i| batch[i].clone()).collect();
        let outcomes = store.settle().finalize(&again, plan).await.unwrap().0;
        for (i, outcome) in busy.into_iter().zip(outcomes) {
            settled[i] = outcome;
        }
    }
}

/// A plan that never retries: the job fails with the attempt's error.
pub fn give_up(f: &onejob::policy::next::FailedJob) -> onejob::policy::next::NextStep {
    onejob::policy::next::NextStep::GiveUp {
        error: f.error.clone(),
    }
}

/// Inserts `n` jobs straight into the tables (as a bulk load would, past
/// intake), keyed `prefix{i}` in one statement, each with the rows
/// settling it would have left: `status` (or the mix), ended `age` to `age +
/// spread` seconds ago, one attempt each (three for a failed job), a succeeded
/// job's winner and result. Jobs and attempts made.
pub async fn fill_jobs(
    db: &mut PgConnection,
    prefix: &str,
    n: i64,
    status: &str,
    age: f64,
    spread: f64,
    operation: &str,
) -> (i64, i64) {
    sqlx::query_as(
        r#"WITH made AS (
               INSERT INTO jobs (id, owner_id, idempotency_key, request_fingerprint, operation, input,
                                 status, version, completed_by, result, error, created_at, updated_at)
               SELECT md5($1::text || i)::uuid, 'tenant-' || (i % 1000), $1::text || i, md5('fp' || $1::text || i), $6::text,
                      jsonb_build_object('text', 'Summarize: ' || repeat(md5(i::text), 6)),
                      s.status, 3,
                      CASE WHEN s.status = 'succeeded' THEN md5(md5($1::text || i)::uuid::text || '-1')::uuid END,
                      CASE WHEN s.status = 'succeeded'
                           THEN jsonb_build_object('summary', repeat(md5((-i)::text), 4)) END,
                      CASE WHEN s.status = 'failed' THEN 'the provider failed three times' END,
                      t.at - interval '4 seconds', t.at
               FROM generate_series(1, $2::bigint) i
               CROSS JOIN LATERAL (SELECT CASE WHEN $3::text <> 'mix' THEN $3::text
                                               WHEN i % 20 = 0 THEN 'cancelled'
                                               WHEN i % 20 < 4 THEN 'failed'
                                               ELSE 'succeeded' END AS status) s
               CROSS JOIN LATERAL (SELECT now() - make_interval(secs => $4 + i * $5 / $2) AS at) t
               RETURNING id, status, updated_at
           ),
           tries AS (
               INSERT INTO attempts (id, job_id, number, provider, status, error, created_at, not_before,
                                     started_at, deadline_at, finished_at, provider_request_id, usage)
               SELECT md5(m.id::text || '-' || k)::uuid, m.id, k, 'primary',
                      CASE m.status WHEN 'failed' THEN 'failed' WHEN 'cancelled' THEN 'cancelled'
                                    WHEN 'unknown' THEN 'unknown' ELSE 'succeeded' END,
                      CASE WHEN m.status = 'failed' THEN 'HTTP 500' END,
                      m.updated_at - interval '4 seconds', m.updated_at - interval '4 seconds',
                      m.updated_at - interval '3 seconds', m.updated_at + interval '57 seconds',
                      CASE WHEN m.status <> 'unknown' THEN m.updated_at END,
                      'req_' || md5(m.id::text || k),
                      jsonb_build_object('prompt_tokens', 412, 'completion_tokens', 96)
               FROM made m
               CROSS JOIN generate_series(1, CASE WHEN m.status = 'failed' THEN 3 ELSE 1 END) k
               RETURNING 1
           )
           SELECT (SELECT count(*) FROM made), (SELECT count(*) FROM tries)"#,
    )
    .bind(prefix)
    .bind(n)
    .bind(status)
    .bind(age)
    .bind(spread)
    .bind(operation)
    .fetch_one(db)
    .await
    .expect("fill")
}
