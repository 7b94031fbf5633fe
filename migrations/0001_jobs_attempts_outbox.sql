-- onejob schema v1: jobs, attempts, and the transactional outbox.
-- The guards live here, not in process memory: identity is a UNIQUE constraint,
-- "one open attempt per job" is a partial unique index, and a trigger refuses any
-- change to a terminal job or a second write of completed_by.

CREATE TABLE jobs (
    id                  uuid        PRIMARY KEY,
    owner_id            text        NOT NULL CHECK (char_length(owner_id) BETWEEN 1 AND 128),
    idempotency_key     text        NOT NULL CHECK (char_length(idempotency_key) BETWEEN 1 AND 255),
    request_fingerprint text        NOT NULL,
    operation           text        NOT NULL,
    input               jsonb       NOT NULL CHECK (jsonb_typeof(input) = 'object'),
    provider            text        NULL,
    status              text        NOT NULL DEFAULT 'queued'
        CHECK (status IN ('queued', 'running', 'unknown', 'succeeded', 'failed', 'cancelled')),
    version             bigint      NOT NULL DEFAULT 0,
    completed_by        uuid        NULL,
    result              jsonb       NULL,
    error               text        NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT jobs_identity UNIQUE (owner_id, idempotency_key),
    CONSTRAINT jobs_succeeded_has_winner
        CHECK ((status = 'succeeded') = (completed_by IS NOT NULL AND result IS NOT NULL))
);

COMMENT ON COLUMN jobs.provider IS 'the provider the intent pinned for its first attempt, if any';
COMMENT ON COLUMN jobs.version IS 'bumped by every write of the job''s outcome; the compare-and-swap reads it';

CREATE TABLE attempts (
    id                  uuid        PRIMARY KEY,
    job_id              uuid        NOT NULL REFERENCES jobs (id),
    number              int         NOT NULL CHECK (number >= 1),
    provider            text        NOT NULL,
    status              text        NOT NULL DEFAULT 'queued'
        CHECK (status IN ('queued', 'started', 'unknown', 'succeeded', 'failed', 'discarded', 'cancelled')),
    error               text        NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    not_before          timestamptz NOT NULL DEFAULT now(),
    started_at          timestamptz NULL,
    deadline_at         timestamptz NULL,
    finished_at         timestamptz NULL,
    provider_request_id text        NULL,
    usage               jsonb       NULL,
    lane                smallint    NOT NULL DEFAULT 0 CHECK (lane IN (0, 1)),
    CONSTRAINT attempts_number UNIQUE (job_id, number)
);

COMMENT ON COLUMN attempts.lane IS '0: the main line of attempts; 1: a hedge started beside it (hedge_after)';

COMMENT ON COLUMN attempts.not_before IS 'the attempt is not published before this time (retry backoff, persisted)';
COMMENT ON COLUMN attempts.deadline_at IS 'started_at + the provider timeout; past it plus a grace the reconciler declares the worker vanished';

-- Invariants 2 and 3: at most one open (queued, started or unknown) attempt per
-- job and lane. Only a hedge uses lane 1, so without hedge_after a job has at most
-- one open attempt, and with it never more than two.
CREATE UNIQUE INDEX attempts_one_open_per_lane ON attempts (job_id, lane)
    WHERE status IN ('queued', 'started', 'unknown');

CREATE INDEX attempts_started_deadline ON attempts (deadline_at) WHERE status = 'started';

ALTER TABLE jobs ADD CONSTRAINT jobs_completed_by_attempt
    FOREIGN KEY (completed_by) REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED;

-- Invariants 4 and 5, enforced below the application: a terminal job never changes
-- again, and completed_by is written once.
CREATE FUNCTION onejob_guard_job() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status IN ('succeeded', 'failed', 'cancelled') THEN
        RAISE EXCEPTION 'job % is % and can never change again', OLD.id, OLD.status
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF OLD.completed_by IS NOT NULL AND NEW.completed_by IS DISTINCT FROM OLD.completed_by THEN
        RAISE EXCEPTION 'job % already completed by attempt %', OLD.id, OLD.completed_by
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF NEW.owner_id <> OLD.owner_id OR NEW.idempotency_key <> OLD.idempotency_key
       OR NEW.request_fingerprint <> OLD.request_fingerprint OR NEW.input <> OLD.input
       OR NEW.operation <> OLD.operation THEN
        RAISE EXCEPTION 'job % identity and intent are immutable', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER jobs_guard BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION onejob_guard_job();

-- Everything that must be published because of a commit is written here in the
-- same transaction, then published with a confirm and marked. A crash between
-- commit and publish leaves the row for the relay.
CREATE TABLE outbox (
    id           bigserial   PRIMARY KEY,
    exchange     text        NOT NULL,
    routing_key  text        NOT NULL,
    message_id   text        NOT NULL,
    body         jsonb       NOT NULL,
    not_before   timestamptz NOT NULL DEFAULT now(),
    lease_until  timestamptz NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz NULL
);

COMMENT ON COLUMN outbox.lease_until IS 'a publisher owns the row until then; the relay takes rows whose lease is over';

CREATE INDEX outbox_pending ON outbox (not_before) WHERE published_at IS NULL;
