-- Retries and hedges take their turn as first attempts do (contract section
-- 7, Owners): the attempt a definite failure or the hedge sweep creates is
-- held in `turns` behind its owner's turns already waiting on its provider,
-- and handed out under the owner's share and `max_in_flight`.
COMMENT ON TABLE turns IS 'attempts waiting their turn (handed_out_at NULL) or handed out and not yet started: every first attempt, retry and hedge; ended when the attempt leaves queued';

-- A queued attempt of a running job counts in flight only when it has no
-- turn: one held is not in flight yet, and one handed out is counted by the
-- turns term (it counted twice). What is left of the term is an attempt
-- created before turns were taken for retries and hedges.
CREATE OR REPLACE FUNCTION owner_in_flight(owner text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT (SELECT count(*) FROM attempts a JOIN jobs j ON j.id = a.job_id
            WHERE a.status IN ('started', 'unknown') AND j.owner_id = owner)
         + (SELECT count(*) FROM attempts a JOIN jobs j ON j.id = a.job_id
            WHERE a.status = 'discarded' AND a.usage IS NULL
              AND a.evidence_next_at IS NOT NULL AND a.evidence = 'stored'
              AND j.owner_id = owner
              AND a.started_at > now() - interval '1 day')
         + (SELECT count(*) FROM jobs j JOIN attempts a ON a.job_id = j.id
            WHERE j.status = 'running' AND j.owner_id = owner AND a.status = 'queued'
              AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.attempt_id = a.id))
         + (SELECT count(*) FROM turns t
            WHERE t.owner_id = owner AND t.handed_out_at IS NOT NULL)
$$;

-- Attempts queued before they took turns (first attempts before 0015,
-- retries and hedges before this migration) get one now, as handed out:
-- their message went to the queue as they were made. So the stuck sweep,
-- which reads the turns handed out rather than every queued attempt, finds
-- them too, and they count in their owner's share and flight as handed-out
-- turns (in flight they counted already, as queued attempts of running
-- jobs). A turn handed out never uses its outbox_id (only a held one's row
-- is made due); 0 stands in where the outbox row was pruned.
INSERT INTO turns (attempt_id, owner_id, provider, outbox_id, due_at, handed_out_at)
SELECT a.id, j.owner_id, a.provider,
       COALESCE((SELECT max(o.id) FROM outbox o WHERE o.message_id = a.id::text), 0),
       a.not_before, now()
FROM attempts a JOIN jobs j ON j.id = a.job_id
WHERE a.status = 'queued' AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.attempt_id = a.id)
ON CONFLICT (attempt_id) DO NOTHING;
