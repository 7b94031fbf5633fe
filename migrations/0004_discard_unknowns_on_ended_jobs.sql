-- An attempt whose outcome was unknown when its job ended (another attempt won,
-- or the job was cancelled) blocks nothing: from this version on it is
-- `discarded` with the reason (contract section 7). Rows left `unknown` on ended
-- jobs by earlier versions are settled the same way, so that the oldest-unknown
-- gauge clears and `unknown` again means "a job waits for a person".
UPDATE attempts a
SET status = 'discarded',
    finished_at = COALESCE(a.finished_at, now()),
    error = 'discarded: ' || COALESCE(a.error, 'outcome unknown') || ' (its job had ended)'
FROM jobs j
WHERE j.id = a.job_id
  AND a.status = 'unknown'
  AND j.status IN ('succeeded', 'failed', 'cancelled');

-- The reconciler deletes published outbox rows past `outbox_retention`.
CREATE INDEX outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;
