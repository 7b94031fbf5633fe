//! Turns: every job's first attempt takes one (and so does a retry or a
//! hedge: `next_turns.rs`). Admission hands it out at once
//! (its message goes to the provider's queue) while its owner has fewer than
//! the provider's share handed out and not yet started, and holds it in
//! Postgres past that; [`Turns::hand_out_turns`](crate::edges::store::Turns::hand_out_turns) hands held turns out as the
//! owner's earlier ones start. An owner with `max_in_flight` has every turn
//! held, and handed out only while its attempts in flight stay under the
//! limit. The table, the trigger that ends a turn when its attempt leaves
//! `queued`, and `owner_in_flight` are in `migrations/0015_turns.sql`.

use super::outbox::{InsertedRow, leased};
use crate::edges::store::drafts::OutboxMessage;
use crate::edges::store::error::Result;
use crate::edges::store::handles::Turns;

/// The most owners one hand-out looks at; the next one goes on after the
/// last of them (a rotation), so every owner is looked at in turn however
/// many wait.
const OWNERS_PER_HAND_OUT: i64 = 1000;

/// The fewest dead rows of `turns` worth a vacuum: about one second of a
/// provider's jobs at a thousand a second.
const TURNS_DEAD_LEAST: f64 = 2000.0;

/// What one hand-out did.
#[derive(Debug, Default)]
pub struct HandOut {
    /// The messages to publish now.
    pub publish: Vec<OutboxMessage>,
    /// Whether any owner had turns held.
    pub waiting: bool,
    /// The last owner it looked at: the next hand-out begins after it.
    pub looked_to: String,
}

impl Turns<'_> {
    /// Hands out the turns held on `provider`: each owner with turns held gets
    /// as many as its share (`share`) and its `max_in_flight` leave room for,
    /// oldest first. Returns the messages to publish now (those the owner's
    /// rate still holds back are the relay's to publish when due), whether
    /// any owner had turns held, and the last owner looked at.
    ///
    /// It looks at [`OWNERS_PER_HAND_OUT`] owners at most, in name order from
    /// the first after `after` (the last one the previous hand-out looked
    /// at), round to the start: past that many waiting owners, each hand-out
    /// goes on where the last stopped, so no owner waits for ever behind
    /// others whatever its name.
    ///
    /// Owners with `max_in_flight` are locked first ([`owner_lock`] in the
    /// migration), in name order, and their flight counted after the lock,
    /// so that hand-outs on several providers and workers, and hedges, never
    /// both see the same room.
    pub async fn hand_out_turns(self, provider: &str, share: i64, after: &str) -> Result<HandOut> {
        let waiting = self.owners_waiting(provider, after, share).await?;
        // The last looked at in the rotation: the last of those round at the
        // start (named up to `after`, so first by name), else the last.
        let Some(looked_to) = waiting
            .iter()
            .rfind(|w| w.wrapped)
            .or(waiting.last())
            .map(|w| w.owner_id.clone())
        else {
            // No owner with room: whether any waits at all.
            return Ok(HandOut {
                waiting: self.any_held(provider).await?,
                looked_to: after.to_owned(),
                ..HandOut::default()
            });
        };
        let owners: Vec<String> = waiting.iter().map(|w| w.owner_id.clone()).collect();
        let limits: Vec<i64> = waiting.iter().map(|w| w.max_in_flight).collect();
        // In name order: the statement sorts them.
        let counted: Vec<String> = waiting
            .iter()
            .filter(|w| w.max_in_flight > 0)
            .map(|w| w.owner_id.clone())
            .collect();
        // With no owner to count, the hand-out is one statement, its own
        // transaction; otherwise the locks come first, in a transaction that
        // holds them until the hand-out commits.
        let rows = if counted.is_empty() {
            self.hand_out(&self.0.pool, &owners, &limits, share, provider)
                .await?
        } else {
            let mut tx = self.0.pool.begin().await?;
            sqlx::query!(
                "SELECT owner_lock(o) FROM unnest($1::text[]) AS o",
                &counted
            )
            .fetch_all(&mut *tx)
            .await?;
            let rows = self
                .hand_out(&mut *tx, &owners, &limits, share, provider)
                .await?;
            tx.commit().await?;
            rows
        };
        Ok(HandOut {
            publish: leased(rows),
            waiting: true,
            looked_to,
        })
    }

    /// The hand-out itself: each owner's room (its share less its turns
    /// handed out, and under `max_in_flight` its room in flight), and that
    /// many of its held turns, oldest first, made due: the outbox row of a
    /// turn that carries its message is written now, that of one written
    /// with its turn is made due.
    async fn hand_out<'e>(
        self,
        on: impl sqlx::PgExecutor<'e>,
        owners: &[String],
        limits: &[i64],
        share: i64,
        provider: &str,
    ) -> Result<Vec<InsertedRow>> {
        Ok(sqlx::query_as!(
            InsertedRow,
            r#"WITH room AS (
                   SELECT o.owner_id,
                          LEAST($3 - (SELECT count(*) FROM turns t
                                      WHERE t.owner_id = o.owner_id AND t.provider = $4
                                        AND t.handed_out_at IS NOT NULL),
                                CASE WHEN o.max_in_flight > 0
                                     THEN o.max_in_flight - owner_in_flight(o.owner_id)
                                     ELSE $3 END) AS room
                   FROM unnest($1::text[], $2::int8[]) AS o(owner_id, max_in_flight)
               ), picked AS (
                   SELECT p.attempt_id, p.outbox_id, p.due_at, p.exchange, p.routing_key,
                          p.body
                   FROM room r CROSS JOIN LATERAL (
                       SELECT t.attempt_id, t.outbox_id, t.due_at, t.exchange, t.routing_key,
                              t.body
                       FROM turns t
                       WHERE t.provider = $4 AND t.owner_id = r.owner_id
                         AND t.handed_out_at IS NULL
                       ORDER BY t.seq
                       LIMIT GREATEST(r.room, 0)
                       FOR UPDATE SKIP LOCKED) p
               ), marked AS (
                   UPDATE turns t SET handed_out_at = now()
                   FROM picked p WHERE t.attempt_id = p.attempt_id
               ), made AS (
                   -- A turn that carries its message: its outbox row now.
                   INSERT INTO outbox (exchange, routing_key, message_id, body, not_before,
                                       lease_until, traceparent, tracestate)
                   SELECT p.exchange, p.routing_key, p.attempt_id::text, p.body,
                          GREATEST(p.due_at, now()),
                          CASE WHEN p.due_at <= now()
                               THEN now() + make_interval(secs => $5) END,
                          j.traceparent, j.tracestate
                   FROM picked p JOIN attempts a ON a.id = p.attempt_id
                   JOIN jobs j ON j.id = a.job_id
                   WHERE p.body IS NOT NULL
                   RETURNING id, exchange, routing_key, message_id, body, traceparent,
                             tracestate, lease_until IS NOT NULL AS leased
               ), made_due AS (
                   -- A turn whose outbox row was written with it: made due.
                   UPDATE outbox ob
                   SET not_before = GREATEST(p.due_at, now()),
                       lease_until = CASE WHEN p.due_at <= now()
                                          THEN now() + make_interval(secs => $5) END
                   FROM picked p
                   WHERE p.body IS NULL AND ob.id = p.outbox_id AND ob.published_at IS NULL
                   RETURNING ob.id, ob.exchange, ob.routing_key, ob.message_id, ob.body,
                             ob.traceparent, ob.tracestate, ob.lease_until IS NOT NULL AS leased
               )
               SELECT id AS "id!", exchange AS "exchange!", routing_key AS "routing_key!",
                      message_id AS "message_id!", body AS "body!", traceparent, tracestate,
                      leased AS "leased!"
               FROM made
               UNION ALL
               SELECT id, exchange, routing_key, message_id, body, traceparent, tracestate,
                      leased
               FROM made_due"#,
            owners,
            limits,
            share,
            provider,
            self.0.routes.lease.as_secs_f64(),
        )
        .fetch_all(on)
        .await?)
    }

    /// The owners with turns held on `provider` and room for one (under
    /// their `share` of its queue and their `max_in_flight`: an owner with
    /// no room takes no place), [`OWNERS_PER_HAND_OUT`] at most: those named
    /// after `after` first, then round to the start (those named up to it,
    /// `wrapped`); returned in name order, each with its `max_in_flight`. One statement: two skip scans of `turns_held`, one
    /// index probe an owner however long its backlog, the second walked only
    /// when the first leaves room (the limit stops the walks). Names are
    /// compared by Postgres, in its collation.
    async fn owners_waiting(self, provider: &str, after: &str, share: i64) -> Result<Vec<Waiting>> {
        Ok(sqlx::query_as!(
            Waiting,
            r#"WITH RECURSIVE later AS (
                   (SELECT owner_id FROM turns
                    WHERE provider = $1 AND handed_out_at IS NULL AND owner_id > $4
                    ORDER BY owner_id LIMIT 1)
                   UNION ALL
                   SELECT (SELECT t.owner_id FROM turns t
                           WHERE t.provider = $1 AND t.handed_out_at IS NULL
                             AND t.owner_id > w.owner_id
                           ORDER BY t.owner_id LIMIT 1)
                   FROM later w WHERE w.owner_id IS NOT NULL
               ), earlier AS (
                   (SELECT owner_id FROM turns
                    WHERE provider = $1 AND handed_out_at IS NULL AND owner_id <= $4
                    ORDER BY owner_id LIMIT 1)
                   UNION ALL
                   SELECT (SELECT t.owner_id FROM turns t
                           WHERE t.provider = $1 AND t.handed_out_at IS NULL
                             AND t.owner_id > w.owner_id AND t.owner_id <= $4
                           ORDER BY t.owner_id LIMIT 1)
                   FROM earlier w WHERE w.owner_id IS NOT NULL
               ), listed AS (
                   -- Only owners with room take a place: under their share
                   -- of the queue, and under their max_in_flight (read
                   -- without the owner's lock: the hand-out counts again
                   -- under it).
                   SELECT w.owner_id, w.wrapped FROM (
                       (SELECT owner_id, false AS wrapped FROM later WHERE owner_id IS NOT NULL)
                       UNION ALL
                       (SELECT owner_id, true FROM earlier WHERE owner_id IS NOT NULL)
                   ) w LEFT JOIN owners o USING (owner_id)
                   WHERE (SELECT count(*) FROM turns t
                          WHERE t.owner_id = w.owner_id AND t.provider = $1
                            AND t.handed_out_at IS NOT NULL) < $5
                     AND (COALESCE(o.max_in_flight, $2) = 0
                          OR owner_in_flight(w.owner_id) < COALESCE(o.max_in_flight, $2))
                   LIMIT $3
               )
               SELECT l.owner_id AS "owner_id!", l.wrapped AS "wrapped!",
                      COALESCE(o.max_in_flight, $2) AS "max_in_flight!"
               FROM listed l LEFT JOIN owners o USING (owner_id)
               ORDER BY l.owner_id"#,
            provider,
            self.0.routes.owners.max_in_flight,
            OWNERS_PER_HAND_OUT,
            after,
            share,
        )
        .fetch_all(&self.0.pool)
        .await?)
    }

    /// Vacuums `turns` once its dead rows pass autovacuum's threshold for it
    /// (with a floor of [`TURNS_DEAD_LEAST`]), whether or not the server runs
    /// autovacuum. Every job writes a turn, hands it out and deletes it, and
    /// the hand-outs and admissions read `turns` by index: they walk every
    /// dead entry of a churned index until a vacuum removes it, and
    /// autovacuum looks only once an `autovacuum_naptime` (a minute by
    /// default), in which a busy provider leaves tens of thousands. The table
    /// holds only the turns waiting and handed out, so its vacuum takes
    /// milliseconds. True when it vacuumed.
    pub async fn vacuum_if_due(self) -> Result<bool> {
        let due = sqlx::query_scalar!(
            r#"SELECT EXISTS (
                   SELECT 1 FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
                   WHERE s.schemaname = current_schema() AND s.relname = 'turns'
                     AND s.n_dead_tup > $1::float8
                         + current_setting('autovacuum_vacuum_scale_factor')::float8
                           * greatest(c.reltuples, 0)) AS "due!""#,
            TURNS_DEAD_LEAST,
        )
        .fetch_one(&self.0.pool)
        .await?;
        if due {
            self.0
                .sweeps()
                .on_busy_tables("VACUUM (SKIP_LOCKED)", &["turns".to_owned()])
                .await?;
        }
        Ok(due)
    }

    /// Whether any owner has turns held on `provider`, room or not.
    async fn any_held(self, provider: &str) -> Result<bool> {
        Ok(sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM turns
                              WHERE provider = $1 AND handed_out_at IS NULL) AS "held!""#,
            provider,
        )
        .fetch_one(&self.0.pool)
        .await?)
    }
}

/// An owner with turns held, and its `max_in_flight` (0: none).
struct Waiting {
    owner_id: String,
    /// Looked at round at the start: named up to the previous look's last.
    wrapped: bool,
    max_in_flight: i64,
}
