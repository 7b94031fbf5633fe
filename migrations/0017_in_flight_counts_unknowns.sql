-- max_in_flight counts every call that may still run (contract section 7,
-- Owners): an attempt `started` or `unknown` (a call that timed out may
-- still be running at the provider, until evidence or an operator settles
-- it), whatever its job's status (a cancelled job's call runs to its end);
-- a queued retry of a running job; and the turns handed out. The attempts
-- are found through the small partial index of open ones, joined to their
-- jobs by key; the retries through the running jobs.
CREATE OR REPLACE FUNCTION owner_in_flight(owner text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT (SELECT count(*) FROM attempts a JOIN jobs j ON j.id = a.job_id
            WHERE a.status IN ('started', 'unknown') AND j.owner_id = owner)
         + (SELECT count(*) FROM jobs j JOIN attempts a ON a.job_id = j.id
            WHERE j.status = 'running' AND j.owner_id = owner AND a.status = 'queued')
         + (SELECT count(*) FROM turns t
            WHERE t.owner_id = owner AND t.handed_out_at IS NOT NULL)
$$;
