-- Admission (src/store/admission.rs, `Store::insert_new`): the new jobs of a
-- batch, each with its first attempt, that attempt's turn and, when the turn
-- is handed out at once, its outbox row, in one statement. $1..$15 and $24 are the batch's columns, $16 the outbox
-- lease, $17 the jobs refused for their owners' budgets (not inserted),
-- $18..$20 the owners with a rate and their buckets, $21..$22 each provider's
-- share, $23 the owners with `max_in_flight`, $24 what each first attempt
-- reserves of its owner's budget (0: nothing; the budget locks are held).
WITH input AS (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                         $6::jsonb[], $7::text[], $8::uuid[], $9::text[],
                         $10::text[], $11::text[], $12::text[], $13::text[],
                         $14::text[], $15::jsonb[], $24::int8[])
        WITH ORDINALITY
        AS t(job_id, owner_id, idempotency_key, fingerprint, operation, input,
             pinned, attempt_id, provider, traceparent, tracestate,
             exchange, routing_key, message_id, body, reserve, position)
), new_jobs AS (
    INSERT INTO jobs (id, owner_id, idempotency_key, request_fingerprint,
                      operation, input, provider, traceparent, tracestate)
    SELECT job_id, owner_id, idempotency_key, fingerprint, operation, input,
           pinned, traceparent, tracestate
    FROM input WHERE job_id <> ALL($17::uuid[]) ORDER BY position
    ON CONFLICT (owner_id, idempotency_key) DO NOTHING
    RETURNING id, owner_id
), paced AS (
    SELECT n.owner_id, r.rate, r.burst,
           owner_pace_take(n.owner_id, count(*), r.rate) AS base
    FROM new_jobs n JOIN unnest($18::text[], $19::float8[], $20::int8[])
                         AS r(owner_id, rate, burst) USING (owner_id)
    GROUP BY n.owner_id, r.rate, r.burst
), due AS (
    SELECT n.id AS job_id, GREATEST(now(), q.base + make_interval(secs =>
               (row_number() OVER (PARTITION BY n.owner_id ORDER BY i.position)
                - q.burst) / q.rate)) AS at
    FROM new_jobs n JOIN input i ON i.job_id = n.id
    JOIN paced q ON q.owner_id = n.owner_id
), standing AS (
    -- Each owner's turns on each provider: how many are handed
    -- out and not yet started, and whether any are held.
    SELECT k.owner_id, k.provider,
           (SELECT count(*) FROM turns t
            WHERE t.owner_id = k.owner_id AND t.provider = k.provider
              AND t.handed_out_at IS NOT NULL) AS out,
           EXISTS (SELECT 1 FROM turns t
                   WHERE t.provider = k.provider AND t.owner_id = k.owner_id
                     AND t.handed_out_at IS NULL) AS waiting
    FROM (SELECT DISTINCT n.owner_id, i.provider
          FROM new_jobs n JOIN input i ON i.job_id = n.id) k
), turn AS (
    -- A new first attempt is handed out at once while its owner
    -- is under its share of the provider's queue and has none
    -- held (those go first); otherwise it is held for the
    -- dispatcher. An owner with `max_in_flight` ($23) has all
    -- of its turns held: only the dispatcher counts its flight.
    SELECT i.job_id, i.attempt_id, n.owner_id, i.provider,
           COALESCE(d.at, now()) AS due,
           (NOT s.waiting AND n.owner_id <> ALL($23)
            AND row_number() OVER (PARTITION BY n.owner_id, i.provider
                                   ORDER BY i.position)
                <= COALESCE(w.share, 2147483647) - s.out) AS handed
    FROM input i JOIN new_jobs n ON n.id = i.job_id
    JOIN standing s ON s.owner_id = n.owner_id AND s.provider = i.provider
    LEFT JOIN unnest($21::text[], $22::int8[]) AS w(provider, share)
           ON w.provider = i.provider
    LEFT JOIN due d ON d.job_id = i.job_id
), new_attempts AS (
    INSERT INTO attempts (id, job_id, number, provider, not_before)
    SELECT attempt_id, job_id, 1, provider, due FROM turn
), reserved AS (
    INSERT INTO reservations (attempt_id, owner_id, tokens)
    SELECT i.attempt_id, i.owner_id, i.reserve
    FROM input i JOIN new_jobs n ON n.id = i.job_id
    WHERE i.reserve > 0
), queued AS (
    -- An outbox row only for a turn handed out now: a held one keeps its
    -- message on the turn until it is handed out (migration 0022).
    INSERT INTO outbox (exchange, routing_key, message_id, body, not_before,
                        lease_until, traceparent, tracestate)
    SELECT i.exchange, i.routing_key, i.message_id, i.body, t.due,
           CASE WHEN t.due <= now() THEN now() + make_interval(secs => $16) END,
           i.traceparent, i.tracestate
    FROM input i JOIN turn t ON t.job_id = i.job_id
    WHERE t.handed
    ORDER BY i.position
    RETURNING id, exchange, routing_key, message_id, body, traceparent,
              tracestate, lease_until IS NOT NULL AS leased
), taken AS (
    INSERT INTO turns (attempt_id, owner_id, provider, outbox_id, due_at,
                       handed_out_at, exchange, routing_key, body)
    SELECT t.attempt_id, t.owner_id, t.provider, q.id, t.due,
           CASE WHEN t.handed THEN now() END,
           CASE WHEN NOT t.handed THEN i.exchange END,
           CASE WHEN NOT t.handed THEN i.routing_key END,
           CASE WHEN NOT t.handed THEN i.body END
    FROM turn t JOIN input i ON i.job_id = t.job_id
    LEFT JOIN queued q ON q.message_id = t.attempt_id::text
)
-- A row for every new job: its outbox row, or (held) its message with no
-- row yet (id 0, not leased).
SELECT id AS "id!", exchange AS "exchange!", routing_key AS "routing_key!",
       message_id AS "message_id!", body AS "body!", traceparent, tracestate,
       leased AS "leased!"
FROM queued
UNION ALL
SELECT 0, i.exchange, i.routing_key, i.message_id, i.body, i.traceparent,
       i.tracestate, false
FROM input i JOIN turn t ON t.job_id = i.job_id
WHERE NOT t.handed
