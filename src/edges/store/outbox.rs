//! The transactional outbox: rows written in the transaction of the change that
//! causes them, claimed by publishers with leases, marked once confirmed, and
//! pruned after `outbox_retention`.

use crate::edges::store::handles::Outbox;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::edges::store::drafts::{OutboxDraft, OutboxMessage};
use crate::edges::store::error::Result;

impl Outbox<'_> {
    pub(super) async fn insert(
        self,
        conn: &mut PgConnection,
        drafts: &[OutboxDraft],
    ) -> Result<Vec<OutboxMessage>> {
        if drafts.is_empty() {
            return Ok(Vec::new());
        }
        let c = OutboxColumns::of(drafts);
        let rows = sqlx::query_as!(
            InsertedRow,
            r#"INSERT INTO outbox (exchange, routing_key, message_id, body, not_before, lease_until,
                                   traceparent, tracestate)
               SELECT d.exchange, d.routing_key, d.message_id, d.body, COALESCE(d.not_before, now()),
                      CASE WHEN d.not_before IS NULL THEN now() + make_interval(secs => $6) END,
                      j.traceparent, j.tracestate
               FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::timestamptz[], $7::uuid[])
                    AS d(exchange, routing_key, message_id, body, not_before, job_id)
               LEFT JOIN jobs j ON j.id = d.job_id
               RETURNING id, exchange, routing_key, message_id, body, traceparent, tracestate,
                         lease_until IS NOT NULL AS "leased!""#,
            &c.exchanges,
            &c.routing_keys,
            &c.message_ids,
            &c.bodies,
            &c.not_before as &[Option<DateTime<Utc>>],
            self.0.routes.lease.as_secs_f64(),
            &c.job_ids,
        )
        .fetch_all(&mut *conn)
        .await?;
        Ok(leased(rows))
    }

    /// Writes the outbox rows, and in the same statement closes the won jobs'
    /// other attempts (`won`: `(job, winner)`): an unknown blocks nothing any
    /// more (discarded), a queued one will never be needed (cancelled). The
    /// statement comes after the compare-and-swap, so its snapshot sees a timeout
    /// that committed while the compare-and-swap waited for the job, which this
    /// transaction now holds. (Its status test is written `(…) IS TRUE` for the
    /// reason [`Settle::start`](crate::edges::store::Settle::start) gives.)
    pub(super) async fn insert_outbox_closing(
        self,
        conn: &mut PgConnection,
        drafts: &[OutboxDraft],
        won: &[(Uuid, Uuid)],
    ) -> Result<Vec<OutboxMessage>> {
        if won.is_empty() {
            return self.insert(conn, drafts).await;
        }
        let c = OutboxColumns::of(drafts);
        let won_jobs: Vec<Uuid> = won.iter().map(|w| w.0).collect();
        let winners: Vec<Uuid> = won.iter().map(|w| w.1).collect();
        let rows = sqlx::query_as!(
            InsertedRow,
            r#"WITH closed AS (
                   UPDATE attempts a
                   SET status = CASE WHEN a.status = 'unknown' THEN 'discarded' ELSE 'cancelled' END,
                       finished_at = now(),
                       evidence_next_at = CASE WHEN a.status = 'unknown' THEN now() END,
                       error = CASE WHEN a.status = 'unknown'
                                    THEN 'discarded: its outcome was still unknown when attempt '
                                         || w.winner || ' won'
                                    ELSE 'cancelled: attempt ' || w.winner || ' won before it started'
                               END
                   FROM unnest($7::uuid[], $8::uuid[]) AS w(job_id, winner)
                   WHERE a.job_id = w.job_id AND (a.status IN ('unknown', 'queued')) IS TRUE
                   RETURNING a.id
               )
               INSERT INTO outbox (exchange, routing_key, message_id, body, not_before, lease_until,
                                   traceparent, tracestate)
               SELECT d.exchange, d.routing_key, d.message_id, d.body, COALESCE(d.not_before, now()),
                      CASE WHEN d.not_before IS NULL THEN now() + make_interval(secs => $6) END,
                      j.traceparent, j.tracestate
               FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::timestamptz[], $9::uuid[])
                    AS d(exchange, routing_key, message_id, body, not_before, job_id)
               LEFT JOIN jobs j ON j.id = d.job_id
               RETURNING id, exchange, routing_key, message_id, body, traceparent, tracestate,
                         lease_until IS NOT NULL AS "leased!""#,
            &c.exchanges,
            &c.routing_keys,
            &c.message_ids,
            &c.bodies,
            &c.not_before as &[Option<DateTime<Utc>>],
            self.0.routes.lease.as_secs_f64(),
            &won_jobs,
            &winners,
            &c.job_ids,
        )
        .fetch_all(&mut *conn)
        .await?;
        Ok(leased(rows))
    }

    /// Takes due outbox rows whose lease is free (or over) for this publisher.
    /// `SKIP LOCKED` lets several relays share the table without waiting.
    pub async fn claim(self, limit: i64) -> Result<Vec<OutboxMessage>> {
        Ok(sqlx::query_as!(
            OutboxMessage,
            "UPDATE outbox SET lease_until = now() + make_interval(secs => $2)
             WHERE id IN (
                 SELECT id FROM outbox
                 WHERE published_at IS NULL AND not_before <= now()
                   AND (lease_until IS NULL OR lease_until < now())
                 ORDER BY id
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED)
             RETURNING id, exchange, routing_key, message_id, body, traceparent, tracestate",
            limit,
            self.0.routes.lease.as_secs_f64(),
        )
        .fetch_all(&self.0.pool)
        .await?)
    }

    /// Deletes up to `limit` outbox rows published more than `retention` ago;
    /// returns how many. Rows not yet published are never touched.
    pub async fn prune_outbox(self, retention: Duration, limit: i64) -> Result<u64> {
        let done = sqlx::query!(
            "DELETE FROM outbox WHERE id IN (
                 SELECT id FROM outbox
                 WHERE published_at < now() - make_interval(secs => $1)
                 ORDER BY published_at
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED)",
            retention.as_secs_f64(),
            limit,
        )
        .execute(&self.0.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Marks outbox rows as published (after the broker confirmed them); a row
    /// marked before keeps its time. By primary key only: a `published_at IS
    /// NULL` test would let the planner scan the partial index `outbox_pending`,
    /// whose entries for rows published a moment ago are dead until vacuum.
    pub async fn mark_published(self, ids: &[i64]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query!(
            "UPDATE outbox SET published_at = COALESCE(published_at, now()) WHERE id = ANY($1)",
            ids
        )
        .execute(&self.0.per_job)
        .await?;
        Ok(())
    }
}

/// The drafts as the column arrays the insert statements unnest.
pub(super) struct OutboxColumns {
    pub(super) exchanges: Vec<String>,
    pub(super) routing_keys: Vec<String>,
    pub(super) message_ids: Vec<String>,
    pub(super) bodies: Vec<Value>,
    not_before: Vec<Option<DateTime<Utc>>>,
    job_ids: Vec<Uuid>,
}

impl OutboxColumns {
    pub(super) fn of(drafts: &[OutboxDraft]) -> Self {
        OutboxColumns {
            exchanges: drafts.iter().map(|d| d.exchange.clone()).collect(),
            routing_keys: drafts.iter().map(|d| d.routing_key.clone()).collect(),
            message_ids: drafts.iter().map(|d| d.message_id.clone()).collect(),
            bodies: drafts.iter().map(|d| d.body.clone()).collect(),
            not_before: drafts.iter().map(|d| d.not_before).collect(),
            job_ids: drafts.iter().map(|d| d.job_id.0).collect(),
        }
    }
}

/// A row the insert statements return.
#[derive(Clone)]
pub(super) struct InsertedRow {
    pub(super) id: i64,
    pub(super) exchange: String,
    pub(super) routing_key: String,
    pub(super) message_id: String,
    pub(super) body: Value,
    pub(super) traceparent: Option<String>,
    pub(super) tracestate: Option<String>,
    pub(super) leased: bool,
}

/// Rows without a not-before time are leased to their writer and handed back for
/// immediate publishing; the relay publishes the others when due.
pub(super) fn leased(rows: Vec<InsertedRow>) -> Vec<OutboxMessage> {
    rows.into_iter()
        .filter(|r| r.leased)
        .map(InsertedRow::message)
        .collect()
}

impl InsertedRow {
    /// The row as a message to publish.
    pub(super) fn message(self) -> OutboxMessage {
        OutboxMessage {
            id: self.id,
            exchange: self.exchange,
            routing_key: self.routing_key,
            message_id: self.message_id,
            body: self.body,
            traceparent: self.traceparent,
            tracestate: self.tracestate,
        }
    }
}
