-- The spend ledger (`owner_spend`, migration 0014) is written once a statement
-- rather than once an attempt: a settlement flush that records the usage of
-- many attempts adds each owner's sum with one upsert, where it upserted once
-- for every attempt (one row write a job, and the most frequent statement of a
-- drain). What counts is unchanged: an attempt's usage counts once, when it is
-- first recorded, as `usage_tokens` reads it.
CREATE OR REPLACE FUNCTION attempts_spend_counted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Most updates of `attempts` (claims, closings) record no usage: they
    -- leave after one look at the rows they changed.
    IF NOT EXISTS (SELECT 1 FROM new_rows WHERE usage IS NOT NULL) THEN
        RETURN NULL;
    END IF;
    INSERT INTO owner_spend (owner_id, minute, stripe, tokens)
    SELECT j.owner_id, date_trunc('minute', now()), pg_backend_pid() % 4,
           sum(usage_tokens(n.usage))
    FROM new_rows n
    JOIN old_rows o ON o.id = n.id
    JOIN jobs j ON j.id = n.job_id
    WHERE o.usage IS NULL AND n.usage IS NOT NULL
    GROUP BY j.owner_id
    HAVING sum(usage_tokens(n.usage)) > 0
    ORDER BY j.owner_id
    ON CONFLICT (owner_id, minute, stripe)
    DO UPDATE SET tokens = owner_spend.tokens + EXCLUDED.tokens;
    RETURN NULL;
END $$;

-- A trigger with transition tables cannot name columns (`UPDATE OF usage`):
-- it fires after every update of `attempts`, and reads only the rows whose
-- usage was first recorded.
DROP TRIGGER IF EXISTS attempts_spend ON attempts;
CREATE TRIGGER attempts_spend
    AFTER UPDATE ON attempts
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION attempts_spend_counted();

DROP FUNCTION IF EXISTS attempts_spend();
