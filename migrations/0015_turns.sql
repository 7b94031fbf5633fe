-- Fair dispatch and `max_in_flight` (contract section 7, Owners).
--
-- Every job's first attempt takes a turn. A turn is handed out (its message
-- goes to the provider's queue) while its owner has fewer than its share of
-- that queue handed out and not yet started; past the share it is held here,
-- its outbox row written but not due (`not_before` is 'infinity'), and a
-- dispatcher hands it out when one of the owner's earlier turns starts. So an
-- owner's backlog waits in Postgres, and the provider's queue holds at most a
-- share of each owner's jobs: another owner's job waits behind a share, not
-- behind a backlog. An owner with `max_in_flight` has every turn held, and
-- handed out only while its attempts in flight stay under the limit.
--
-- A turn lasts while its attempt is `queued`: the trigger below ends it when
-- the attempt leaves `queued` whatever the path (claimed, cancelled, failed,
-- discarded), and drops the outbox row of a turn that was never handed out.
CREATE TABLE IF NOT EXISTS turns (
    attempt_id     uuid        PRIMARY KEY REFERENCES attempts (id) ON DELETE CASCADE,
    owner_id       text        NOT NULL,
    provider       text        NOT NULL,
    outbox_id      bigint      NOT NULL,
    -- When the owner's rate lets the attempt go (admission's pace).
    due_at         timestamptz NOT NULL,
    seq            bigserial   NOT NULL,
    -- NULL while held.
    handed_out_at  timestamptz NULL
);

COMMENT ON TABLE turns IS 'first attempts waiting their turn (handed_out_at NULL) or handed out and not yet started; ended when the attempt leaves queued';

CREATE INDEX IF NOT EXISTS turns_held ON turns (provider, owner_id, seq)
    WHERE handed_out_at IS NULL;
CREATE INDEX IF NOT EXISTS turns_handed_out ON turns (owner_id, provider)
    WHERE handed_out_at IS NOT NULL;

CREATE OR REPLACE FUNCTION attempts_turn_taken() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    ended turns%ROWTYPE;
BEGIN
    DELETE FROM turns WHERE attempt_id = OLD.id RETURNING * INTO ended;
    IF FOUND AND ended.handed_out_at IS NULL THEN
        DELETE FROM outbox WHERE id = ended.outbox_id AND published_at IS NULL;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS attempts_turn_taken ON attempts;
CREATE TRIGGER attempts_turn_taken
    AFTER UPDATE OF status ON attempts
    FOR EACH ROW
    WHEN (OLD.status = 'queued' AND NEW.status <> 'queued')
    EXECUTE FUNCTION attempts_turn_taken();

-- An owner's attempts in flight, as `max_in_flight` counts them: those
-- `started` or about to start (queued) of its running jobs, and its turns
-- handed out. Running jobs are few (a provider's slots' worth), so this reads
-- little however large the owner's backlog.
CREATE OR REPLACE FUNCTION owner_in_flight(owner text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT (SELECT count(*) FROM jobs j JOIN attempts a ON a.job_id = j.id
            WHERE j.status = 'running' AND j.owner_id = owner
              AND a.status IN ('queued', 'started'))
         + (SELECT count(*) FROM turns t
            WHERE t.owner_id = owner AND t.handed_out_at IS NOT NULL)
$$;

-- The lock that makes one owner's hand-outs and hedges take turns, so that
-- two workers never both see room under `max_in_flight` for the same slot.
CREATE OR REPLACE FUNCTION owner_lock(owner text) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtextextended('onejob.owner:' || owner, 0))
$$;
