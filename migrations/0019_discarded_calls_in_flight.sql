-- max_in_flight counts every call that may still run (contract section 7,
-- Owners). An attempt `discarded` while its outcome was unknown (another
-- attempt won, its job was cancelled, or its call timed out after its job
-- ended) may still be running at the provider: when its call asked for
-- stored evidence (the only kind that can tell what a discarded call cost),
-- it counts while evidence still looks for its cost (its next look set, its
-- usage not known), and for a day after its call started at most (a provider
-- removed from the configuration is looked at by no one, and its discarded
-- attempts must not hold their owner's flight for ever). Once the evidence
-- found its cost or gave up, its next look is NULL. Its budget reservation
-- is kept as long (the trigger of 0018), and released then.
UPDATE attempts SET evidence_next_at = NULL
WHERE status = 'discarded' AND evidence_next_at > now() + interval '50 years';

CREATE INDEX IF NOT EXISTS attempts_discarded_looked_at ON attempts (job_id)
    WHERE status = 'discarded' AND usage IS NULL AND evidence_next_at IS NOT NULL
      AND evidence = 'stored';

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
            WHERE j.status = 'running' AND j.owner_id = owner AND a.status = 'queued')
         + (SELECT count(*) FROM turns t
            WHERE t.owner_id = owner AND t.handed_out_at IS NOT NULL)
$$;
