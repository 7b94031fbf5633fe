-- Claiming (src/store/settle/claim.rs, `Store::claim`): queued attempts moved
-- to `started` under the claim's token, their jobs locked first (skipping
-- rows held under someone else's lock) and marked `running`. $1 the
-- attempts, $2 their provider, $3 its timeout in seconds, $4 the claim's
-- token, $5 the evidence the calls ask for, $6 [owners]'s `daily_tokens`.
-- Each row is an attempt `started` (by this claim, or by an earlier try of
-- it whose reply was lost), `unreserved` (its owner has a budget and it holds
-- no reservation: not started) or `busy` (its job row was held).
WITH candidates AS (
    SELECT id, job_id, (status = 'started') AS ours FROM attempts
    WHERE id = ANY($1) AND provider = $2
      AND ((status = 'queued') IS TRUE
           OR (status = 'started' AND claim = $4) IS TRUE)
), unreserved AS (
    -- Queued attempts of owners with a budget ($6 is
    -- [owners]'s) that hold no reservation (a retry, a
    -- hedge, a job admitted before its owner had a
    -- budget): they reserve before they start.
    SELECT c.id, c.job_id, j.operation, j.input, j.owner_id
    FROM candidates c JOIN jobs j ON j.id = c.job_id
    LEFT JOIN owners o ON o.owner_id = j.owner_id
    WHERE NOT c.ours AND j.status IN ('queued', 'running')
      AND COALESCE(o.daily_tokens, $6) > 0
      AND NOT EXISTS (SELECT 1 FROM reservations r WHERE r.attempt_id = c.id)
), claimed AS (
    SELECT j.id FROM jobs j
    WHERE j.id IN (SELECT job_id FROM candidates WHERE NOT ours
                     AND id NOT IN (SELECT id FROM unreserved))
      AND j.status IN ('queued', 'running')
    ORDER BY j.id
    FOR UPDATE SKIP LOCKED
), started AS (
    UPDATE attempts a
    SET status = 'started', claim = $4, evidence = $5,
        started_at = COALESCE(a.started_at, now()),
        deadline_at = COALESCE(a.deadline_at, now() + make_interval(secs => $3))
    FROM claimed c
    WHERE a.id = ANY($1) AND a.job_id = c.id AND a.provider = $2
      AND (a.status = 'queued') IS TRUE
      AND a.id NOT IN (SELECT id FROM unreserved)
    RETURNING a.id, a.job_id, a.number
), running AS (
    UPDATE jobs j SET status = 'running', updated_at = now()
    FROM (SELECT DISTINCT job_id FROM started) s
    WHERE j.id = s.job_id
    RETURNING j.id, j.version, j.operation, j.input
)
SELECT s.id AS "attempt_id!: AttemptId", s.job_id AS "job_id!: JobId",
       s.number AS "number!", r.version AS "version!",
       r.operation AS "operation!", r.input AS "input!",
       '' AS "owner_id!", 'started' AS "kind!"
FROM started s JOIN running r ON r.id = s.job_id
UNION ALL
-- Attempts this claim started in a try whose reply was lost:
-- already its own, their jobs already running, so no lock
-- is needed (a held job row does not make them wait).
SELECT a.id, a.job_id, a.number, j.version, j.operation, j.input, '', 'started'
FROM candidates c
JOIN attempts a ON a.id = c.id
JOIN jobs j ON j.id = c.job_id
WHERE c.ours AND j.status IN ('queued', 'running')
UNION ALL
-- Attempts to reserve before they start.
SELECT u.id, u.job_id, 0, 0, u.operation, u.input, u.owner_id, 'unreserved'
FROM unreserved u
UNION ALL
-- Queued attempts of open jobs that the lock skipped.
SELECT c.id, c.job_id, 0, 0, '', '{}'::jsonb, '', 'busy'
FROM candidates c JOIN jobs j ON j.id = c.job_id
WHERE NOT c.ours AND j.status IN ('queued', 'running')
  AND c.id NOT IN (SELECT id FROM unreserved)
  AND c.job_id NOT IN (SELECT id FROM claimed)
