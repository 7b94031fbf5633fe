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
