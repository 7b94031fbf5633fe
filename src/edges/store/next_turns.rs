//! Turns for the attempts after a job's first: a retry (created by the
//! settlement of a definite failure) and a hedge (created by the hedge
//! sweep) take their turn as a first attempt does, so that neither goes
//! straight to the provider's queue ahead of other owners' first attempts.
//! Each is held: its outbox row is written not due, and the provider's
//! hand-out ([`Turns::hand_out_turns`](crate::edges::store::Turns::hand_out_turns)) hands it out behind its owner's
//! turns already waiting there, under the owner's share and
//! `max_in_flight`.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::domain::{AttemptId, JobId};
use crate::edges::store::Store;
use crate::edges::store::drafts::OutboxDraft;
use crate::edges::store::error::Result;

/// An attempt, other than a job's first, that takes a turn.
pub(super) struct NextTurn<'a> {
    pub(super) attempt: AttemptId,
    pub(super) job: JobId,
    pub(super) provider: &'a str,
    /// When it may go (a retry's backoff); `None`: now.
    pub(super) due: Option<DateTime<Utc>>,
}

impl Store {
    /// Holds a turn for each of `next` (attempts just inserted, in the
    /// caller's transaction): its message written to the outbox not due,
    /// and its turn in its owner's line on its provider, due at its
    /// backoff's end.
    pub(super) async fn hold_turns(
        &self,
        conn: &mut PgConnection,
        next: &[NextTurn<'_>],
    ) -> Result<()> {
        if next.is_empty() {
            return Ok(());
        }
        let drafts: Vec<OutboxDraft> = next
            .iter()
            .map(|n| {
                self.routes
                    .attempt_draft(n.attempt, n.job, n.provider, None)
            })
            .collect();
        let attempts: Vec<Uuid> = next.iter().map(|n| n.attempt.0).collect();
        let jobs: Vec<Uuid> = next.iter().map(|n| n.job.0).collect();
        let providers: Vec<String> = next.iter().map(|n| n.provider.to_owned()).collect();
        let due: Vec<Option<DateTime<Utc>>> = next.iter().map(|n| n.due).collect();
        let routing_keys: Vec<String> = drafts.iter().map(|d| d.routing_key.clone()).collect();
        let bodies: Vec<Value> = drafts.into_iter().map(|d| d.body).collect();
        sqlx::query!(
            "WITH input AS (
                 SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::timestamptz[],
                                      $5::text[], $6::jsonb[])
                     AS i(attempt_id, job_id, provider, due, routing_key, body)
             ), held AS (
                 INSERT INTO outbox (exchange, routing_key, message_id, body, not_before,
                                     traceparent, tracestate)
                 SELECT $7, i.routing_key, i.attempt_id::text, i.body, 'infinity',
                        j.traceparent, j.tracestate
                 FROM input i JOIN jobs j ON j.id = i.job_id
                 RETURNING id, message_id
             )
             INSERT INTO turns (attempt_id, owner_id, provider, outbox_id, due_at)
             SELECT i.attempt_id, j.owner_id, i.provider, h.id, COALESCE(i.due, now())
             FROM input i JOIN jobs j ON j.id = i.job_id
             JOIN held h ON h.message_id = i.attempt_id::text",
            &attempts,
            &jobs,
            &providers,
            &due as &[Option<DateTime<Utc>>],
            &routing_keys,
            &bodies,
            self.routes.work_exchange,
        )
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}
