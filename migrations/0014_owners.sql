-- Per-owner limits and spend (contract section 7, Owners).
--
-- `owners` holds what `onejob owners set` gave an owner: a NULL setting takes
-- `[owners]`'s from onejob.toml, and 0 means "no limit". An owner with no row
-- has `[owners]`'s limits.
CREATE TABLE IF NOT EXISTS owners (
    owner_id       text        PRIMARY KEY,
    max_in_flight  bigint      NULL CHECK (max_in_flight >= 0),
    rate           float8      NULL CHECK (rate >= 0),
    burst          bigint      NULL CHECK (burst >= 0),
    daily_tokens   bigint      NULL CHECK (daily_tokens >= 0),
    updated_at     timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE owners IS 'per-owner limits set by `onejob owners set`; NULL takes [owners] from onejob.toml, 0 is no limit';

-- What each owner spent, in provider-reported tokens, by the minute. A row is
-- written by the trigger below when an attempt's usage is first recorded, so
-- every way an attempt ends (won, failed, discarded, settled from evidence)
-- counts, and counts once. `stripe` spreads one owner's minute over a few rows
-- (by the writing session), so that concurrent settlements of one owner do not
-- queue for one row lock. The budget sums the last 24 hours' rows.
CREATE TABLE IF NOT EXISTS owner_spend (
    owner_id  text        NOT NULL,
    minute    timestamptz NOT NULL,
    stripe    smallint    NOT NULL,
    tokens    bigint      NOT NULL,
    PRIMARY KEY (owner_id, minute, stripe)
);

CREATE INDEX IF NOT EXISTS owner_spend_by_minute ON owner_spend (minute);

-- The tokens a provider's usage report counts: `total_tokens`, else
-- `prompt_tokens` + `completion_tokens`. The report is outside text: anything
-- that is not a number counts 0, and a number is held to 0 .. 10^15.
CREATE OR REPLACE FUNCTION usage_tokens(usage jsonb) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT LEAST(GREATEST(COALESCE(
        CASE WHEN jsonb_typeof(usage -> 'total_tokens') = 'number'
             THEN (usage ->> 'total_tokens')::numeric END,
        COALESCE(CASE WHEN jsonb_typeof(usage -> 'prompt_tokens') = 'number'
                      THEN (usage ->> 'prompt_tokens')::numeric END, 0)
        + COALESCE(CASE WHEN jsonb_typeof(usage -> 'completion_tokens') = 'number'
                        THEN (usage ->> 'completion_tokens')::numeric END, 0)
    ), 0), 1e15)::bigint
$$;

CREATE OR REPLACE FUNCTION attempts_spend() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    spent bigint := usage_tokens(NEW.usage);
BEGIN
    IF spent > 0 THEN
        INSERT INTO owner_spend (owner_id, minute, stripe, tokens)
        SELECT j.owner_id, date_trunc('minute', now()), pg_backend_pid() % 4, spent
        FROM jobs j WHERE j.id = NEW.job_id
        ON CONFLICT (owner_id, minute, stripe)
        DO UPDATE SET tokens = owner_spend.tokens + EXCLUDED.tokens;
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS attempts_spend ON attempts;
CREATE TRIGGER attempts_spend
    AFTER UPDATE OF usage ON attempts
    FOR EACH ROW WHEN (OLD.usage IS NULL AND NEW.usage IS NOT NULL)
    EXECUTE FUNCTION attempts_spend();

-- The rate limit's token bucket, kept as the generic cell rate algorithm's one
-- time per owner: `next_at` is when the owner's next intent would be due if
-- its bucket were empty. Admission moves it on by 1/rate for each job it
-- creates and gives the job's first attempt its due time.
CREATE TABLE IF NOT EXISTS owner_pace (
    owner_id  text        PRIMARY KEY,
    next_at   timestamptz NOT NULL
);

-- Takes `jobs` places in an owner's bucket at `rate` a second: moves its time
-- on by jobs/rate and returns where the time stood, but not before now. The
-- k-th of these jobs (from 1) is due at that time + (k - burst)/rate, or now
-- if that is earlier: with a full bucket, the first `burst` at once.
CREATE OR REPLACE FUNCTION owner_pace_take(owner text, jobs bigint, rate float8)
RETURNS timestamptz
LANGUAGE sql VOLATILE AS $$
    INSERT INTO owner_pace AS p (owner_id, next_at)
    VALUES (owner, now() + make_interval(secs => jobs / rate))
    ON CONFLICT (owner_id) DO UPDATE
    SET next_at = GREATEST(p.next_at, now()) + make_interval(secs => jobs / rate)
    RETURNING next_at - make_interval(secs => jobs / rate)
$$;
